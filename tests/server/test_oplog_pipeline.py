"""The op-log's pure rules that both backends call: rebuilding a state from the log, when a
commit writes a snapshot, and how a lane op at or below its mark is answered."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cv_mutations import SubDocState, fingerprint, parse_op
from cv_server.oplog import Committed, Forgotten, IncomingOp, OpLogCorrupted, Rejected
from cv_server.oplog.pipeline import (
    OP_EXPIRED,
    SEQ_GAP,
    plan_commit,
    rebuild_from_log,
    snapshot_due,
)

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


# -- lanes: a seq at or below the mark without record (docs/ops.md#exactly-once) ---------------

CLIENT = "client-0000000000001"
NOW_MS = 1_800_000_000_000
#: The oldest `minted_at` inside the window: one day back.
EXPIRED_BEFORE = NOW_MS - 86_400_000


def lane_op(op_id: str, seq: int, minted_at: int | None = NOW_MS) -> IncomingOp:
    raw: dict[str, Any] = {
        "type": "node.increment",
        "node_id": "root",
        "field": "n",
        "by": 1,
        "op_id": op_id,
        "client_id": CLIENT,
        "seq": seq,
    }
    if minted_at is not None:
        raw["minted_at"] = minted_at
    return IncomingOp(op=parse_op(raw), raw=raw, fingerprint=fingerprint(raw))


def test_a_renumbered_op_is_applied_after_a_stale_copy_took_its_seq() -> None:
    """D (seq 5) was given up while a copy was in flight; the SDK renumbered E to seq 5; the
    stale copy of D is decided at 5. E at seq 5 was never applied: it is refused `seq_gap`
    expecting 6, not answered as a duplicate, and applied once sent as seq 6."""
    state = SubDocState.empty()
    marks = {CLIENT: 4}
    stale_d = plan_commit(
        state, 0, [lane_op("op-d-0001", 5)], {}, marks=marks, expired_before=EXPIRED_BEFORE
    )
    assert [type(o) for o in stale_d.outcomes] == [Committed]
    marks.update(stale_d.marks)
    assert marks == {CLIENT: 5}

    e_at_5 = plan_commit(
        state,
        stale_d.clock,
        [lane_op("op-e-0001", 5), lane_op("op-f-0001", 6)],
        {},
        marks=marks,
        expired_before=EXPIRED_BEFORE,
    )
    first, second = e_at_5.outcomes
    assert isinstance(first, Rejected)
    assert (first.code, first.expected_seq) == (SEQ_GAP, 6)
    # F is not decided before E: seq n+1 never goes ahead of n.
    assert isinstance(second, Rejected)
    assert second.code == SEQ_GAP
    assert e_at_5.entries == []
    assert e_at_5.marks == {}

    renumbered = plan_commit(
        state,
        e_at_5.clock,
        [lane_op("op-e-0001", 6), lane_op("op-f-0001", 7)],
        {},
        marks=marks,
        expired_before=EXPIRED_BEFORE,
    )
    assert renumbered.outcomes == [Committed("op-e-0001", 2), Committed("op-f-0001", 3)]
    assert state.nodes["root"].fields["n"] == 3


def test_an_op_below_its_mark_minted_before_the_window_is_a_forgotten_duplicate() -> None:
    state = SubDocState.empty()
    old = lane_op("op-old-0001", 3, minted_at=EXPIRED_BEFORE - 1)
    plan = plan_commit(state, 9, [old], {}, marks={CLIENT: 5}, expired_before=EXPIRED_BEFORE)
    assert plan.outcomes == [Forgotten("op-old-0001")]
    assert plan.entries == []
    assert "n" not in state.nodes["root"].fields


def test_an_op_below_its_mark_without_a_window_is_refused_so_it_is_renumbered() -> None:
    """No window: op_id records are kept forever, so no record means never applied."""
    old = lane_op("op-old-0001", 3, minted_at=0)
    plan = plan_commit(SubDocState.empty(), 9, [old], {}, marks={CLIENT: 5})
    (outcome,) = plan.outcomes
    assert isinstance(outcome, Rejected)
    assert (outcome.code, outcome.expected_seq) == (SEQ_GAP, 6)


def test_a_lane_op_without_minted_at_below_its_mark_is_expired() -> None:
    """It cannot prove its age: neither applied on a guess nor claimed as applied."""
    op = lane_op("op-undated-01", 3, minted_at=None)
    plan = plan_commit(
        SubDocState.empty(), 9, [op], {}, marks={CLIENT: 5}, expired_before=EXPIRED_BEFORE
    )
    (outcome,) = plan.outcomes
    assert isinstance(outcome, Rejected)
    assert (outcome.code, outcome.clock) == (OP_EXPIRED, 9)
    assert plan.entries == []


def test_a_lane_op_dated_in_the_future_below_its_mark_is_expired() -> None:
    """A clock far ahead would pass a compacted op off as young: its date proves nothing."""
    op = lane_op("op-future-01", 3, minted_at=NOW_MS + 3_600_000)
    plan = plan_commit(
        SubDocState.empty(),
        9,
        [op],
        {},
        marks={CLIENT: 5},
        expired_before=EXPIRED_BEFORE,
        latest_minted_at=NOW_MS + 300_000,
    )
    (outcome,) = plan.outcomes
    assert isinstance(outcome, Rejected)
    assert outcome.code == OP_EXPIRED
