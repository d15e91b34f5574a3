"""Properties the server's cache relies on.

- a state shares no mutable value with the ops applied to it, nor with the JSON it was loaded from;
- state equality is byte equality (`True`, `1` and `1.0` are different JSON);
- `canonical_json` writes one text per value, whatever sits next to it;
- the exported schemas and `parse_op` accept the same instances;
- `plan_commit` leaves the cached state equal to the replay of the log rows it planned, and
  `revert()` (or an unexpected error) takes it back to the byte.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from cv_mutations import (
    OP_TYPES,
    InvalidOp,
    NodeIncrement,
    NodeInsert,
    NodeMove,
    NodeUpdate,
    Op,
    SubDocState,
    apply_op,
    canonical_json,
    fingerprint,
    parse_op,
)
from cv_mutations.schema import SCHEMA_DIR
from cv_server.oplog import pipeline
from cv_server.oplog.pipeline import Recorded, RecordedCommit, RecordedRejection, plan_commit
from cv_server.oplog.store import Committed, IncomingOp, Rejected
from tests.mutations.helpers import outcome, start_state
from tests.mutations.strategies import json_values, op_sequences, pool_ops, pool_trees

PROPERTY = settings(max_examples=150, deadline=None)

Sequence = tuple[list[NodeInsert], list[Op]]


def containers(value: Any) -> Iterator[list[Any] | dict[str, Any]]:
    """Every list and dict inside `value`, outermost first."""
    if isinstance(value, dict):
        yield value
        for item in value.values():
            yield from containers(item)
    elif isinstance(value, list):
        yield value
        for item in value:
            yield from containers(item)


def vandalize(value: Any) -> int:
    """Append to every list and add a key to every dict nested inside `value`; how many."""
    found = list(containers(value))
    for container in found:
        if isinstance(container, list):
            container.append("vandal")
        else:
            container["vandal"] = "vandal"
    return len(found)


# -- no aliasing between a state and what it was built from ---------------------------------------

nested_values = json_values.filter(lambda value: isinstance(value, list | dict))


@PROPERTY
@given(nested_values)
def test_editing_an_inserts_nested_fields_after_the_apply_does_not_edit_the_state(
    value: Any,
) -> None:
    # Built in Python, not parsed: pydantic keeps the caller's nested objects inside the op.
    state = SubDocState.empty()
    op = NodeInsert(node_id="n", parent_id="root", fields={"k": value})
    apply_op(state, op)
    before = state.dumps()
    assert vandalize(op.fields["k"]) > 0
    assert state.dumps() == before


@PROPERTY
@given(nested_values, st.booleans())
def test_editing_an_updates_nested_values_after_the_apply_does_not_edit_the_state(
    value: Any, existed: bool
) -> None:
    state = SubDocState.empty()
    if existed:
        apply_op(state, NodeUpdate(node_id="root", set={"k": "old"}))
    op = NodeUpdate(node_id="root", set={"k": value})
    undo = apply_op(state, op)
    before = state.dumps()
    vandalize(op.set["k"])
    assert state.dumps() == before
    # And the other way round: what the state holds can change without changing the op (the
    # client keeps ops in its outbox to resend them).
    sent = json.dumps(op.model_dump(mode="json"), sort_keys=True)
    vandalize(state.nodes["root"].fields["k"])
    assert json.dumps(op.model_dump(mode="json"), sort_keys=True) == sent
    undo()
    assert state.nodes["root"].fields == ({"k": "old"} if existed else {})


def test_a_state_loaded_from_json_shares_nothing_with_its_input() -> None:
    data: dict[str, Any] = {
        "nodes": {
            "root": {"parent": None, "children": ["a"], "fields": {"tags": ["x"], "d": {"k": 1}}},
            "a": {"parent": "root", "children": [], "fields": {}},
        }
    }
    state = SubDocState.from_json(data)
    before = state.dumps()
    vandalize(data["nodes"]["root"]["fields"])
    data["nodes"]["root"]["children"].append("ghost")
    assert state.dumps() == before
    state.check()


# -- equality is JSON equality --------------------------------------------------------------------

_look_alikes = st.sampled_from(
    [
        0,
        0.0,
        -0.0,
        False,
        1,
        1.0,
        True,
        None,
        "1",
        [],
        {},
        [1],
        [1.0],
        [True],
        {"a": 1},
        {"a": True},
    ]
)


@PROPERTY
@given(_look_alikes, _look_alikes)
def test_states_are_equal_exactly_when_their_bytes_are(left: Any, right: Any) -> None:
    # The server's cache must equal the replay of its log; an `==` that takes True for 1 or 1.0
    # for 1 cannot tell a cache that drifted to another JSON type from the log's state.
    a, b = SubDocState.empty(), SubDocState.empty()
    a.nodes["root"].fields["x"] = left
    b.nodes["root"].fields["x"] = right
    assert (a == b) is (a.dumps() == b.dumps())


def test_an_increment_by_a_float_one_does_not_equal_an_increment_by_an_int_one() -> None:
    by_int, by_float = SubDocState.empty(), SubDocState.empty()
    apply_op(by_int, NodeIncrement(node_id="root", field="n", by=1))
    apply_op(by_float, NodeIncrement(node_id="root", field="n", by=1.0))
    assert by_int.dumps() != by_float.dumps()
    assert by_int != by_float
    # ...so the two ops must not share a fingerprint either (a retry must repeat its own bytes).
    raw = {"type": "node.increment", "node_id": "root", "field": "n"}
    assert fingerprint({**raw, "by": 1}) != fingerprint({**raw, "by": 1.0})


def test_unicode_forms_of_a_field_name_are_different_fields_and_different_ops() -> None:
    nfc, nfd = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
    assert nfc != nfd
    state = SubDocState.empty()
    apply_op(state, NodeUpdate(node_id="root", set={nfc: 1}))
    apply_op(state, NodeUpdate(node_id="root", set={nfd: 2}))
    assert state.nodes["root"].fields == {nfc: 1, nfd: 2}
    assert SubDocState.loads(state.dumps()) == state
    raw = {"type": "node.update", "node_id": "root"}
    assert fingerprint({**raw, "set": {nfc: 1}}) != fingerprint({**raw, "set": {nfd: 1}})


@pytest.mark.parametrize(
    ("start", "by", "expected"),
    [
        (-0.0, -0.0, "-0.0"),
        (-0.0, 0, "0.0"),
        (0, -0.0, "0.0"),
        (2**64, 1, str(2**64 + 1)),
        (-(2**63) - 1, -1, str(-(2**63) - 2)),
        (2**1024, 0.5, None),  # int + float: OverflowError inside the sum
        (2**1023, 2.0**1023, None),  # an exact int and a float whose float sum is inf
    ],
)
def test_increment_edges_apply_as_json_numbers_or_leave_the_state_alone(
    start: int | float, by: int | float, expected: str | None
) -> None:
    state = SubDocState.empty()
    apply_op(state, NodeUpdate(node_id="root", set={"n": start}))
    before = state.dumps()
    code = outcome(state, NodeIncrement(node_id="root", field="n", by=by))
    if expected is None:
        assert code == "not_a_number"
        assert state.dumps() == before
    else:
        assert code is None
        assert json.dumps(state.nodes["root"].fields["n"]) == expected
        assert SubDocState.loads(state.dumps()) == state


# -- a state reloaded from its snapshot goes on exactly like the cached one ----------------------


@PROPERTY
@given(op_sequences, st.data())
def test_a_snapshot_reloaded_mid_sequence_answers_the_rest_like_the_cached_state(
    sequence: Sequence, data: st.DataObject
) -> None:
    # What a restart does: load the last snapshot, replay the log's tail. Dict order changes
    # (dumps sorts keys); nothing a reducer answers may depend on it.
    start, ops = sequence
    cut = data.draw(st.integers(min_value=0, max_value=len(ops)))
    cached = start_state(start)
    for op in ops[:cut]:
        outcome(cached, op)
    reloaded = SubDocState.loads(cached.dumps())
    for op in ops[cut:]:
        assert outcome(cached, op) == outcome(reloaded, op), op
        assert cached == reloaded


# -- canonical JSON -------------------------------------------------------------------------------

BIG = 2**80


@pytest.mark.parametrize("value", [1e-05, 1e-07, 1e16, 1e22, 5e-324, 0.1, -0.0, 123.456])
def test_a_float_keeps_its_canonical_text_next_to_a_big_integer(value: float) -> None:
    alone = canonical_json({"v": value})
    assert canonical_json({"big": BIG, "v": value}) == f'{{"big":{BIG},{alone[1:]}'


@PROPERTY
@given(json_values)
def test_canonical_json_writes_one_text_per_value_whatever_its_neighbours(value: Any) -> None:
    # A fingerprint is only comparable if a value is written the same way in every op; it used
    # to depend on whether an unrelated key held an integer past 64 bits.
    assert canonical_json({"big": BIG, "v": value}) == (
        f'{{"big":{BIG},"v":{canonical_json(value)}}}'
    )
    # The text is JSON, and it reads back as the same value.
    assert json.loads(canonical_json(value)) == value


# -- schemas and parse_op agree ------------------------------------------------------------------


def _validator(name: str) -> Draft202012Validator:
    return Draft202012Validator(json.loads((SCHEMA_DIR / name).read_text("utf-8")))


UNION = _validator("op.schema.json")
PER_TYPE = {op_type: _validator(f"{op_type}.schema.json") for op_type in OP_TYPES}

GOOD: dict[str, dict[str, Any]] = {
    "node.insert": {"type": "node.insert", "node_id": "a", "parent_id": "root", "index": 0},
    "node.move": {"type": "node.move", "node_id": "a", "parent_id": "root", "index": 0},
    "node.delete": {"type": "node.delete", "node_id": "a"},
    "node.update": {"type": "node.update", "node_id": "a", "set": {"k": 1}, "unset": ["j"]},
    "node.increment": {"type": "node.increment", "node_id": "a", "field": "n", "by": 1},
}
KEYS = {
    "node.insert": ("node_id", "parent_id", "index", "fields"),
    "node.move": ("node_id", "parent_id", "index"),
    "node.delete": ("node_id",),
    "node.update": ("node_id", "set", "unset"),
    "node.increment": ("node_id", "field", "by"),
}
_wire_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=3),
    st.sampled_from([2**70, -(2**70), 0.0, 1.0, 2.0, -1.0, 0.5, 1e300, -0.0]),
    # No lone surrogates, no "\n" at the end (python-jsonschema's `$` quirk): both are known,
    # documented differences (test_ops, test_schemas).
    st.text(alphabet="ab_.:-é ", max_size=3),
    st.sampled_from(["a", "root", "k", "j", "abcdefgh", "x" * 129]),
)
# Keys of drawn objects avoid "k" and "j", so set and unset never overlap (parse_op's own rule).
_wire_values = st.recursive(
    _wire_scalars,
    lambda inner: (
        st.lists(inner, max_size=2)
        | st.dictionaries(st.sampled_from(["", "a", "b", "c" * 129]), inner, max_size=2)
    ),
    max_leaves=4,
)


def _accepted(body: dict[str, Any]) -> bool:
    try:
        parse_op(body)
    except InvalidOp:
        return False
    return True


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(OP_TYPES), st.data())
def test_the_schema_and_parse_op_accept_the_same_instances(
    op_type: str, data: st.DataObject
) -> None:
    body = dict(GOOD[op_type])
    for key in data.draw(st.lists(st.sampled_from([*KEYS[op_type], "op_id", "meta"]), max_size=2)):
        if data.draw(st.booleans(), label=f"drop {key}"):
            body.pop(key, None)
        else:
            body[key] = data.draw(_wire_values, label=key)
    set_, unset = body.get("set"), body.get("unset")
    if isinstance(set_, dict) and isinstance(unset, list):
        # A field both set and unset is parse_op's own rule, which JSON Schema cannot state
        # (the schema's description says it): a scalar "k" drawn into `unset` meets GOOD's set.
        assume(not set_.keys() & {name for name in unset if isinstance(name, str)})
    schema_says = PER_TYPE[op_type].is_valid(body)
    assert UNION.is_valid(body) is schema_says
    assert _accepted(body) is schema_says, body


@pytest.mark.parametrize("op_type", ["node.insert", "node.move"])
@pytest.mark.parametrize("index", [0.0, 1.0, 1e2])
def test_an_integral_float_index_is_an_integer_for_the_schema_and_for_parse_op(
    op_type: str, index: float
) -> None:
    # JSON Schema's "integer" is any number with a zero fraction; a client serializing a double
    # sends 1.0. parse_op accepts what the published schema allows.
    body = {**GOOD[op_type], "index": index}
    assert UNION.is_valid(body)
    op = parse_op(body)
    assert isinstance(op, NodeInsert | NodeMove)
    assert op.index == int(index)
    assert type(op.index) is int


# -- plan_commit: the cache equals the replay of the planned log rows ------------------------------

_OP_IDS = st.none() | st.sampled_from(["op_id_one", "op_id_two", "op_id_three"])


def incoming(op: Op, op_id: str | None) -> IncomingOp:
    raw = op.model_copy(update={"op_id": op_id}).model_dump(mode="json", exclude_none=True)
    return IncomingOp(op=parse_op(raw), raw=raw, fingerprint=fingerprint(raw))


@st.composite
def batches(
    draw: st.DrawFn,
) -> tuple[list[NodeInsert], list[IncomingOp], dict[str, Recorded], bool]:
    start = draw(pool_trees)
    # Ops aimed at a few ids so the batch keeps touching the same nodes; op_ids from a pool of
    # three, so repeats (same op) and reuses (another op) both happen inside a batch.
    ops = draw(st.lists(st.tuples(pool_ops, _OP_IDS), min_size=1, max_size=12))
    batch = [incoming(op, op_id) for op, op_id in ops]
    for index in draw(st.lists(st.integers(0, len(batch) - 1), max_size=3)):
        batch.insert(index + 1, batch[index])  # an exact repeat of an earlier op
    recorded: dict[str, Recorded] = {}
    for op_id in draw(st.lists(st.sampled_from(["op_id_one", "op_id_two"]), unique=True)):
        same = [item.fingerprint for item in batch if item.op_id == op_id][:1]
        print_ = draw(st.sampled_from([*same, "0" * 64]))
        if draw(st.booleans()):
            recorded[op_id] = RecordedCommit(clock=1, fingerprint=print_)
        else:
            recorded[op_id] = RecordedRejection("node_not_found", "recorded", print_)
    return start, batch, recorded, draw(st.booleans())


@settings(max_examples=200, deadline=None)
@given(batches())
def test_a_planned_batch_leaves_the_state_of_its_log_rows_and_revert_restores_the_start(
    case: tuple[list[NodeInsert], list[IncomingOp], dict[str, Recorded], bool],
) -> None:
    start, batch, recorded, atomic = case
    state = start_state(start)
    before = state.dumps()
    head = 5
    plan = plan_commit(state, head, batch, recorded, atomic=atomic)

    assert len(plan.outcomes) == len(batch)
    assert [entry.clock for entry in plan.entries] == list(range(head + 1, plan.clock + 1))
    assert plan.base_clock == head
    assert len(plan.undos) == len(plan.entries)
    committed_here = [
        o for o in plan.outcomes if isinstance(o, Committed) and not o.duplicate and o.clock > head
    ]
    assert len(committed_here) == len(plan.entries)
    if atomic and any(isinstance(o, Rejected) for o in plan.outcomes):
        assert plan.entries == []
        assert state.dumps() == before

    # The in-memory state is exactly the start plus the log rows (what a restart would replay).
    replayed = start_state(start)
    for entry in plan.entries:
        apply_op(replayed, parse_op(entry.op))
    assert state == replayed
    state.check()

    # An op_id is in the log at most once, and its recorded rejection is not also a commit.
    logged = [entry.op_id for entry in plan.entries if entry.op_id is not None]
    assert len(logged) == len(set(logged))
    assert not set(logged) & set(recorded)
    assert not set(logged) & {rejection.op_id for rejection in plan.rejections}

    # The transaction that should write them fails: the cache goes back to the byte.
    plan.revert()
    assert state.dumps() == before
    assert plan.undos == []
    plan.revert()  # a second revert has nothing left to undo
    assert state.dumps() == before


@pytest.mark.parametrize("atomic", [False, True])
def test_an_unexpected_reducer_error_mid_batch_leaves_the_state_as_it_was(
    monkeypatch: pytest.MonkeyPatch, atomic: bool
) -> None:
    # No plan comes back to revert, so plan_commit itself must take back the ops it applied
    # (the SQLite store registers its rollback undo only once it holds a plan).
    state = SubDocState.empty()
    before = state.dumps()
    calls = 0
    real_apply = apply_op

    def failing_third(target: SubDocState, op: Op) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("reducer bug")
        return real_apply(target, op)

    monkeypatch.setattr(pipeline, "apply_op", failing_third)  # the name plan_commit calls
    batch = [
        incoming(NodeInsert(node_id="a", parent_id="root"), "op_id_one"),
        incoming(NodeIncrement(node_id="a", field="n", by=2), None),
        incoming(NodeUpdate(node_id="a", set={"n": "x"}), "op_id_two"),
    ]
    with pytest.raises(RuntimeError, match="reducer bug"):
        plan_commit(state, 0, batch, {}, atomic=atomic)
    assert state.dumps() == before
