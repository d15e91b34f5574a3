"""What the SDK reads off the wire without I/O (`cv_workspace_client._core.wire`)."""

from __future__ import annotations

from typing import Any

import pytest

from cv_workspace_client._core.wire import commit_time


def test_a_commit_time_in_seconds_reads_as_a_float() -> None:
    assert commit_time(1764641333.118) == 1764641333.118
    assert commit_time(1764641333) == 1764641333.0


@pytest.mark.parametrize("value", [None, "1764641333.1", True, float("nan"), float("inf"), [1]])
def test_a_commit_time_that_is_absent_or_not_a_number_reads_as_none(value: Any) -> None:
    assert commit_time(value) is None
