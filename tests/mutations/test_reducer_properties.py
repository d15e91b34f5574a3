"""Property tests: no op sequence, valid or not, can break the tree or leave a half-applied op."""

from __future__ import annotations

import json

from hypothesis import event, given, settings
from hypothesis import strategies as st

from cv_mutations import REJECTION_CODES, NodeInsert, Op, OpRejected, SubDocState, Undo, apply_op
from tests.mutations.helpers import outcome, start_state
from tests.mutations.reference import reference_apply, tree_problems
from tests.mutations.strategies import aimed_op, op_sequences, pool_trees

PROPERTY = settings(max_examples=300, deadline=None)

Sequence = tuple[list[NodeInsert], list[Op]]


def _refuse_non_json(constant: str) -> None:
    raise AssertionError(f"state text holds {constant}, which is not JSON")


def assert_whole(state: SubDocState) -> None:
    # Checked after every op in every test, not only at the end: a reducer bug that corrupted the
    # tree could otherwise send a later op's ancestor walk round a parent cycle forever.
    assert tree_problems(state.to_json()) == []


@PROPERTY
@given(op_sequences)
def test_random_ops_keep_the_tree_whole_and_agree_with_the_reference(sequence: Sequence) -> None:
    start, ops = sequence
    state = start_state(start)
    expected = state.to_json()
    for op in ops:
        before = state.dumps()
        expected, expected_code = reference_apply(expected, op)
        code = outcome(state, op)
        event(f"{op.type}: {code or 'applied'}")
        assert code == expected_code, op
        if code is not None:
            assert code in REJECTION_CODES
            assert state.dumps() == before, "a rejected op changed the state"
        state.check()
        assert_whole(state)
        assert state.to_json() == expected


@settings(max_examples=200, deadline=None)
@given(pool_trees, st.data())
def test_ops_aimed_at_live_nodes_agree_with_the_reference_at_every_edge(
    start: list[NodeInsert], data: st.DataObject
) -> None:
    state = start_state(start)
    expected = state.to_json()
    for _ in range(data.draw(st.integers(min_value=1, max_value=20))):
        op = aimed_op(data, state)
        before = state.dumps()
        expected, expected_code = reference_apply(expected, op)
        code = outcome(state, op)
        event(f"{op.type}: {code or 'applied'}")
        assert code == expected_code, op
        if code is not None:
            assert state.dumps() == before, "a rejected op changed the state"
        assert_whole(state)
        assert state.to_json() == expected


@PROPERTY
@given(op_sequences)
def test_each_undo_restores_the_exact_prior_state(sequence: Sequence) -> None:
    start, ops = sequence
    state = start_state(start)
    for op in ops:
        before = state.dumps()
        try:
            undo = apply_op(state, op)
        except OpRejected:
            continue
        assert_whole(state)
        after = state.dumps()
        undo()
        assert state.dumps() == before, op
        apply_op(state, op)
        assert state.dumps() == after, op


@PROPERTY
@given(op_sequences)
def test_undoing_a_whole_sequence_in_reverse_restores_the_start(sequence: Sequence) -> None:
    # What the server does to roll an atomic batch out of its in-memory state.
    start, ops = sequence
    state = start_state(start)
    initial = state.dumps()
    snapshots: list[str] = []
    undos: list[Undo] = []
    for op in ops:
        snapshot = state.dumps()
        try:
            undos.append(apply_op(state, op))
        except OpRejected:
            continue
        assert_whole(state)
        snapshots.append(snapshot)
    for undo, snapshot in zip(reversed(undos), reversed(snapshots), strict=True):
        undo()
        assert state.dumps() == snapshot
        assert_whole(state)
    assert state.dumps() == initial


@PROPERTY
@given(op_sequences)
def test_any_reachable_state_round_trips_through_json(sequence: Sequence) -> None:
    start, ops = sequence
    state = start_state(start)
    for op in ops:
        outcome(state, op)
        assert_whole(state)
    text = state.dumps()
    json.loads(text, parse_constant=_refuse_non_json)  # strict JSON: no NaN or Infinity
    text.encode()  # valid UTF-8: no lone surrogates
    again = SubDocState.loads(text)
    assert again == state
    assert again.dumps() == text
    assert SubDocState.from_json(json.loads(json.dumps(state.to_json()))) == state
