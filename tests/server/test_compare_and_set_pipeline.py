"""Compare-and-set in the sans-I/O commit pipeline (`plan_commit(..., if_clock=)`,
docs/ops.md#conflicts), as properties: based on the head, a batch is decided exactly as without
`if_clock`; based on any other clock, nothing is applied, every op not decided before is
`version_conflict` carrying the head, and every op decided before keeps its stored answer."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from cv_mutations import SubDocState, apply_op, fingerprint, parse_op
from cv_server.oplog import Committed, IncomingOp, Rejected
from cv_server.oplog.pipeline import (
    VERSION_CONFLICT,
    Recorded,
    RecordedCommit,
    RecordedRejection,
    plan_commit,
)

HEAD = 3


def op(kind: str, op_id: str | None, node: str) -> IncomingOp:
    raw: dict[str, Any]
    if kind == "insert":
        raw = {"type": "node.insert", "node_id": node, "parent_id": "root"}
    else:
        raw = {"type": "node.increment", "node_id": node, "field": "n", "by": 1}
    if op_id is not None:
        raw["op_id"] = op_id
    return IncomingOp(op=parse_op(raw), raw=raw, fingerprint=fingerprint(raw))


def base_state() -> SubDocState:
    state = SubDocState.empty()
    apply_op(state, parse_op({"type": "node.insert", "node_id": "a", "parent_id": "root"}))
    return state


ops_strategy = st.lists(
    st.tuples(
        st.sampled_from(["insert", "increment"]),
        st.sampled_from([None, "op-00000001", "op-00000002", "op-00000003", "op-00000004"]),
        st.sampled_from(["a", "b", "c"]),
    ),
    min_size=1,
    max_size=6,
)
#: What the log already holds: op-00000001 committed at 2, op-00000002 rejected.
RECORDED_IDS = st.sets(st.sampled_from(["op-00000001", "op-00000002"]))


def recorded_for(ids: set[str], ops: list[IncomingOp]) -> dict[str, Recorded]:
    """Records for `ids`, fingerprinted as the first op of the batch under each id (so they
    are duplicates, not reuses)."""
    found: dict[str, Recorded] = {}
    for incoming in ops:
        op_id = incoming.op_id
        if op_id in ids and op_id not in found:
            if op_id == "op-00000001":
                found[op_id] = RecordedCommit(2, incoming.fingerprint)
            else:
                found[op_id] = RecordedRejection("node_exists", "taken", incoming.fingerprint)
    return found


@settings(max_examples=200, deadline=None)
@given(ops_strategy, RECORDED_IDS, st.booleans())
def test_based_on_the_head_a_batch_is_decided_as_without_if_clock(
    shape: list[tuple[str, str | None, str]], ids: set[str], atomic: bool
) -> None:
    ops = [op(*item) for item in shape]
    recorded = recorded_for(ids, ops)
    plain_state, cas_state = base_state(), base_state()
    plain = plan_commit(plain_state, HEAD, ops, recorded, atomic=atomic)
    cas = plan_commit(cas_state, HEAD, ops, recorded, atomic=atomic, if_clock=HEAD)
    assert cas.outcomes == plain.outcomes
    assert cas.entries == plain.entries
    assert cas.rejections == plain.rejections
    assert cas_state.to_json() == plain_state.to_json()


@settings(max_examples=200, deadline=None)
@given(ops_strategy, RECORDED_IDS, st.booleans(), st.sampled_from([0, 1, 2, 4, 10]))
def test_based_on_another_clock_nothing_is_applied_and_only_new_ops_conflict(
    shape: list[tuple[str, str | None, str]], ids: set[str], atomic: bool, if_clock: int
) -> None:
    ops = [op(*item) for item in shape]
    recorded = recorded_for(ids, ops)
    state = base_state()
    plan = plan_commit(state, HEAD, ops, recorded, atomic=atomic, if_clock=if_clock)
    assert plan.entries == []
    assert plan.clock == HEAD
    assert state.to_json() == base_state().to_json()
    first_print: dict[str, str] = {}
    for incoming, outcome in zip(ops, plan.outcomes, strict=True):
        op_id = incoming.op_id
        record = recorded.get(op_id or "")
        seen = None if op_id is None else first_print.get(op_id)
        if op_id is not None:
            first_print.setdefault(op_id, incoming.fingerprint)
        if (seen is not None and seen != incoming.fingerprint) or (
            record is not None and record.fingerprint != incoming.fingerprint
        ):
            assert isinstance(outcome, Rejected)
            assert outcome.code == "op_id_reuse"  # decided before the clock check, as ever
        elif isinstance(record, RecordedCommit):
            assert outcome == Committed(op_id, record.clock, True)
        elif isinstance(record, RecordedRejection):
            assert isinstance(outcome, Rejected)
            assert (outcome.code, outcome.duplicate) == ("node_exists", True)
        else:
            assert isinstance(outcome, Rejected)
            assert (outcome.code, outcome.clock) == (VERSION_CONFLICT, HEAD)
            assert outcome.duplicate == (seen is not None)
    # Conflicts are recorded (a retry gets them again), each op_id once.
    assert all(r.code == VERSION_CONFLICT for r in plan.rejections)
    assert {r.op_id for r in plan.rejections} == {
        o.op_id for o in ops if o.op_id is not None and o.op_id not in recorded
    }
