"""The op-log's pure rules that both backends call: rebuilding a state from the log, and when a
commit writes a snapshot."""

from __future__ import annotations

import json

import pytest

from cv_mutations import SubDocState
from cv_server.oplog import OpLogCorrupted
from cv_server.oplog.pipeline import rebuild_from_log, snapshot_due

KEY = ("ws", "doc")


def increment(by: int = 1) -> str:
    return json.dumps({"type": "node.increment", "node_id": "root", "field": "n", "by": by})


def test_the_log_rebuilds_the_state_and_returns_the_clock_reached() -> None:
    state = SubDocState.empty()
    clock = rebuild_from_log(state, 0, [(1, increment()), (2, increment(2))], KEY)
    assert clock == 2
    assert state.nodes["root"].fields["n"] == 3


def test_an_empty_log_leaves_the_clock_where_it_was() -> None:
    assert rebuild_from_log(SubDocState.empty(), 7, [], KEY) == 7


def test_a_gap_in_the_log_is_corruption() -> None:
    with pytest.raises(OpLogCorrupted, match="clock 1 to 3"):
        rebuild_from_log(SubDocState.empty(), 0, [(1, increment()), (3, increment())], KEY)


def test_a_logged_op_its_history_rejects_is_corruption() -> None:
    bad = json.dumps({"type": "node.increment", "node_id": "ghost", "field": "n", "by": 1})
    with pytest.raises(OpLogCorrupted, match="clock 1"):
        rebuild_from_log(SubDocState.empty(), 0, [(1, bad)], KEY)


@pytest.mark.parametrize(
    ("head", "clock", "due"),
    [(0, 4, False), (0, 5, True), (4, 5, True), (5, 9, False), (4, 11, True), (9, 10, True)],
)
def test_a_snapshot_is_due_when_a_commit_reaches_or_passes_a_multiple(
    head: int, clock: int, due: bool
) -> None:
    assert snapshot_due(head, clock, 5) is due
