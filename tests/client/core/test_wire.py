"""What the SDK reads off the wire without I/O (`cv_workspace_client._core.wire`)."""

from __future__ import annotations

from typing import Any

import pytest

from cv_workspace_client._core.wire import commit_time, parse_results
from cv_workspace_client.errors import ProtocolError
from cv_workspace_client.models import Commit


def test_a_commit_time_in_seconds_reads_as_a_float() -> None:
    assert commit_time(1764641333.118) == 1764641333.118
    assert commit_time(1764641333) == 1764641333.0


@pytest.mark.parametrize("value", [None, "1764641333.1", True, float("nan"), float("inf"), [1]])
def test_a_commit_time_that_is_absent_or_not_a_number_reads_as_none(value: Any) -> None:
    assert commit_time(value) is None


def test_an_explicit_null_clock_on_a_duplicate_is_a_decided_op_no_longer_on_record() -> None:
    outcomes = parse_results(["a"], [{"op_id": "a", "clock": None, "duplicate": True}])
    assert outcomes == [Commit(clock=0, op_id="a", duplicate=True)]


@pytest.mark.parametrize(
    "result",
    [
        {"op_id": "a", "duplicate": True},  # no clock at all: garbled, not "forgotten"
        {"op_id": "a", "clock": None},  # a null clock that is no duplicate
        {"op_id": "a", "clock": None, "duplicate": False},
    ],
)
def test_an_answer_without_a_usable_clock_does_not_fit_and_is_resent(result: Any) -> None:
    assert isinstance(parse_results(["a"], [result]), ProtocolError)
