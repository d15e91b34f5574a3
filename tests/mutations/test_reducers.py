"""apply_op, op by op and code by code (docs/ops.md)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pydantic import JsonValue

from cv_mutations import (
    REJECTION_CODES,
    NodeDelete,
    NodeIncrement,
    NodeInsert,
    NodeMove,
    NodeUpdate,
    Op,
    OpRejected,
    SubDocState,
    apply_op,
)
from tests.mutations.reference import tree_problems


def build(
    shape: dict[str, list[str]], fields: dict[str, dict[str, JsonValue]] | None = None
) -> SubDocState:
    """A state from `{parent: [children...]}`, inserted top-down through the reducers."""
    state = SubDocState.empty()
    pending = ["root"]
    while pending:
        parent = pending.pop(0)
        for child in shape.get(parent, []):
            apply_op(
                state,
                NodeInsert(node_id=child, parent_id=parent, fields=(fields or {}).get(child, {})),
            )
            pending.append(child)
    return state


def children(state: SubDocState, node_id: str) -> list[str]:
    return list(state.nodes[node_id].children)


def rejected(state: SubDocState, op: Op) -> str:
    """Apply an op that must be rejected; assert the state did not move; return the code."""
    before = state.dumps()
    with pytest.raises(OpRejected) as caught:
        apply_op(state, op)
    assert state.dumps() == before
    assert caught.value.code in REJECTION_CODES
    assert caught.value.message
    return caught.value.code


def applied_and_undone(state: SubDocState, op: Op) -> None:
    """Apply, check the tree, undo, and check the exact prior text came back; then re-apply."""
    before = state.dumps()
    undo = apply_op(state, op)
    after = state.dumps()
    assert tree_problems(state.to_json()) == []
    undo()
    assert state.dumps() == before
    apply_op(state, op)
    assert state.dumps() == after


@pytest.fixture
def tree() -> SubDocState:
    #   root ─ a ─ a1, a2, a3
    #        ─ b ─ b1 ─ b11
    #        ─ c
    return build({"root": ["a", "b", "c"], "a": ["a1", "a2", "a3"], "b": ["b1"], "b1": ["b11"]})


def test_the_rejection_codes_are_exactly_the_documented_ones() -> None:
    assert {
        "node_exists",
        "parent_not_found",
        "index_out_of_range",
        "node_not_found",
        "cycle",
        "root_immutable",
        "not_a_number",
    } == REJECTION_CODES


def test_the_empty_state_is_a_lone_root() -> None:
    state = SubDocState.empty()
    assert state.to_json() == {"nodes": {"root": {"parent": None, "children": [], "fields": {}}}}
    assert len(state) == 1


# -- node.insert ---------------------------------------------------------------------------------


def test_insert_without_index_appends(tree: SubDocState) -> None:
    apply_op(tree, NodeInsert(node_id="a4", parent_id="a"))
    assert children(tree, "a") == ["a1", "a2", "a3", "a4"]
    assert tree.nodes["a4"].parent == "a"
    assert tree.nodes["a4"].children == []


@pytest.mark.parametrize(
    ("index", "expected"),
    [(0, ["n", "a1", "a2", "a3"]), (1, ["a1", "n", "a2", "a3"]), (3, ["a1", "a2", "a3", "n"])],
)
def test_insert_at_index_puts_the_node_at_that_position(
    tree: SubDocState, index: int, expected: list[str]
) -> None:
    apply_op(tree, NodeInsert(node_id="n", parent_id="a", index=index))
    assert children(tree, "a") == expected


def test_insert_stores_a_copy_of_the_fields(tree: SubDocState) -> None:
    op = NodeInsert(node_id="n", parent_id="c", fields={"title": "T", "tags": ["x"]})
    apply_op(tree, op)
    assert tree.nodes["n"].fields == {"title": "T", "tags": ["x"]}
    tree.nodes["n"].fields["title"] = "changed"
    assert op.fields["title"] == "T"


def test_insert_of_an_existing_id_is_node_exists(tree: SubDocState) -> None:
    assert rejected(tree, NodeInsert(node_id="a1", parent_id="c")) == "node_exists"
    assert rejected(tree, NodeInsert(node_id="root", parent_id="c")) == "node_exists"


def test_insert_under_a_missing_parent_is_parent_not_found(tree: SubDocState) -> None:
    assert rejected(tree, NodeInsert(node_id="n", parent_id="ghost")) == "parent_not_found"


def test_insert_past_the_end_is_index_out_of_range(tree: SubDocState) -> None:
    assert rejected(tree, NodeInsert(node_id="n", parent_id="a", index=4)) == "index_out_of_range"
    assert rejected(tree, NodeInsert(node_id="n", parent_id="c", index=1)) == "index_out_of_range"


def test_insert_is_undone_exactly(tree: SubDocState) -> None:
    applied_and_undone(tree, NodeInsert(node_id="n", parent_id="a", index=1, fields={"k": 1}))


# -- node.move -----------------------------------------------------------------------------------


def test_move_to_another_parent_carries_the_subtree(tree: SubDocState) -> None:
    apply_op(tree, NodeMove(node_id="b1", parent_id="a", index=1))
    assert children(tree, "a") == ["a1", "b1", "a2", "a3"]
    assert children(tree, "b") == []
    assert tree.nodes["b1"].parent == "a"
    assert children(tree, "b1") == ["b11"]
    assert tree.nodes["b11"].parent == "b1"


@pytest.mark.parametrize(
    ("node", "index", "expected"),
    [
        # The index counts the siblings after the node has been taken out.
        ("a1", 0, ["a1", "a2", "a3"]),
        ("a1", 1, ["a2", "a1", "a3"]),
        ("a1", 2, ["a2", "a3", "a1"]),
        ("a3", 0, ["a3", "a1", "a2"]),
        ("a3", 2, ["a1", "a2", "a3"]),
        ("a2", 0, ["a2", "a1", "a3"]),
        ("a2", 2, ["a1", "a3", "a2"]),
    ],
)
def test_move_within_the_same_parent_counts_the_index_after_removal(
    tree: SubDocState, node: str, index: int, expected: list[str]
) -> None:
    apply_op(tree, NodeMove(node_id=node, parent_id="a", index=index))
    assert children(tree, "a") == expected
    assert tree.nodes[node].parent == "a"


def test_move_within_the_same_parent_past_the_last_slot_is_index_out_of_range(
    tree: SubDocState,
) -> None:
    # Three children, one taken out: slots 0..2 exist, 3 does not.
    assert rejected(tree, NodeMove(node_id="a1", parent_id="a", index=3)) == "index_out_of_range"


def test_move_to_another_parent_past_its_end_is_index_out_of_range(tree: SubDocState) -> None:
    assert rejected(tree, NodeMove(node_id="c", parent_id="a", index=4)) == "index_out_of_range"
    apply_op(tree, NodeMove(node_id="c", parent_id="a", index=3))
    assert children(tree, "a") == ["a1", "a2", "a3", "c"]


def test_move_of_a_missing_node_is_node_not_found(tree: SubDocState) -> None:
    assert rejected(tree, NodeMove(node_id="ghost", parent_id="a", index=0)) == "node_not_found"


def test_move_under_a_missing_parent_is_parent_not_found(tree: SubDocState) -> None:
    assert rejected(tree, NodeMove(node_id="a1", parent_id="ghost", index=0)) == "parent_not_found"


@pytest.mark.parametrize(
    ("node", "new_parent"), [("b", "b"), ("b", "b1"), ("b", "b11"), ("b1", "b11")]
)
def test_move_under_itself_or_its_own_subtree_is_cycle(
    tree: SubDocState, node: str, new_parent: str
) -> None:
    assert rejected(tree, NodeMove(node_id=node, parent_id=new_parent, index=0)) == "cycle"


def test_move_of_the_root_is_root_immutable(tree: SubDocState) -> None:
    assert rejected(tree, NodeMove(node_id="root", parent_id="a", index=0)) == "root_immutable"
    assert rejected(tree, NodeMove(node_id="root", parent_id="root", index=0)) == "root_immutable"


def test_move_to_its_own_place_changes_nothing(tree: SubDocState) -> None:
    before = tree.dumps()
    apply_op(tree, NodeMove(node_id="a2", parent_id="a", index=1))
    assert tree.dumps() == before


@pytest.mark.parametrize(
    "op",
    [
        NodeMove(node_id="a1", parent_id="a", index=2),
        NodeMove(node_id="a3", parent_id="a", index=0),
        NodeMove(node_id="b", parent_id="a", index=0),
        NodeMove(node_id="b11", parent_id="root", index=3),
    ],
)
def test_move_is_undone_exactly(tree: SubDocState, op: NodeMove) -> None:
    applied_and_undone(tree, op)


# -- node.delete ---------------------------------------------------------------------------------


def test_delete_of_a_leaf_removes_it_from_its_parent(tree: SubDocState) -> None:
    apply_op(tree, NodeDelete(node_id="a2"))
    assert children(tree, "a") == ["a1", "a3"]
    assert "a2" not in tree.nodes


def test_delete_removes_the_whole_subtree(tree: SubDocState) -> None:
    apply_op(tree, NodeDelete(node_id="b"))
    assert set(tree.nodes) == {"root", "a", "a1", "a2", "a3", "c"}
    assert children(tree, "root") == ["a", "c"]
    assert tree_problems(tree.to_json()) == []


def test_a_deleted_id_can_be_inserted_again(tree: SubDocState) -> None:
    apply_op(tree, NodeDelete(node_id="b"))
    apply_op(tree, NodeInsert(node_id="b11", parent_id="c"))
    assert tree.nodes["b11"].parent == "c"


def test_delete_of_a_missing_node_is_node_not_found(tree: SubDocState) -> None:
    assert rejected(tree, NodeDelete(node_id="ghost")) == "node_not_found"
    apply_op(tree, NodeDelete(node_id="b"))
    assert rejected(tree, NodeDelete(node_id="b11")) == "node_not_found"


def test_delete_of_the_root_is_root_immutable(tree: SubDocState) -> None:
    assert rejected(tree, NodeDelete(node_id="root")) == "root_immutable"


@pytest.mark.parametrize("node", ["a2", "b", "a"])
def test_delete_is_undone_exactly(tree: SubDocState, node: str) -> None:
    applied_and_undone(tree, NodeDelete(node_id=node))


# -- node.update ---------------------------------------------------------------------------------


def test_update_sets_and_unsets_fields() -> None:
    state = build({"root": ["n"]}, {"n": {"keep": 1, "drop": 2, "change": 3}})
    apply_op(
        state, NodeUpdate(node_id="n", set={"change": "x", "new": [1, {"a": None}]}, unset=["drop"])
    )
    assert state.nodes["n"].fields == {"keep": 1, "change": "x", "new": [1, {"a": None}]}


def test_update_unset_of_an_absent_field_is_a_no_op() -> None:
    state = build({"root": ["n"]}, {"n": {"keep": 1}})
    before = state.dumps()
    apply_op(state, NodeUpdate(node_id="n", unset=["absent"]))
    assert state.dumps() == before


def test_update_of_a_missing_node_is_node_not_found(tree: SubDocState) -> None:
    assert rejected(tree, NodeUpdate(node_id="ghost", set={"k": 1})) == "node_not_found"


def test_update_may_change_the_root_fields(tree: SubDocState) -> None:
    apply_op(tree, NodeUpdate(node_id="root", set={"title": "doc"}))
    assert tree.nodes["root"].fields == {"title": "doc"}


def test_update_is_undone_exactly() -> None:
    state = build({"root": ["n"]}, {"n": {"keep": 1, "drop": 2, "change": 3}})
    applied_and_undone(
        state, NodeUpdate(node_id="n", set={"change": 4, "new": 5}, unset=["drop", "absent"])
    )


# -- node.increment ------------------------------------------------------------------------------


def test_increment_adds_to_a_number() -> None:
    state = build({"root": ["n"]}, {"n": {"count": 5, "ratio": 0.5}})
    apply_op(state, NodeIncrement(node_id="n", field="count", by=3))
    apply_op(state, NodeIncrement(node_id="n", field="ratio", by=0.25))
    apply_op(state, NodeIncrement(node_id="n", field="count", by=-10))
    assert state.nodes["n"].fields == {"count": -2, "ratio": 0.75}
    assert type(state.nodes["n"].fields["count"]) is int


def test_increment_of_a_missing_field_counts_from_zero() -> None:
    state = build({"root": ["n"]})
    apply_op(state, NodeIncrement(node_id="n", field="count", by=7))
    assert state.nodes["n"].fields == {"count": 7}
    apply_op(state, NodeIncrement(node_id="n", field="hits"))
    assert state.nodes["n"].fields == {"count": 7, "hits": 1}


def test_increment_applied_twice_counts_twice() -> None:
    # Deliberately not idempotent: this is how the exactly-once tests see a double apply.
    state = build({"root": ["n"]})
    op = NodeIncrement(node_id="n", field="count", by=1, op_id="sameopid")
    apply_op(state, op)
    apply_op(state, op)
    assert state.nodes["n"].fields["count"] == 2


@pytest.mark.parametrize("value", [True, False, "3", None, [1], {"n": 1}])
def test_increment_of_a_non_number_is_not_a_number(value: JsonValue) -> None:
    state = build({"root": ["n"]}, {"n": {"f": value}})
    assert rejected(state, NodeIncrement(node_id="n", field="f", by=1)) == "not_a_number"


def test_a_bool_field_is_not_a_number_even_though_python_bool_is_an_int() -> None:
    state = build({"root": ["n"]}, {"n": {"flag": True}})
    assert rejected(state, NodeIncrement(node_id="n", field="flag", by=1)) == "not_a_number"
    assert state.nodes["n"].fields["flag"] is True


@pytest.mark.parametrize(
    ("start", "by"), [(1.7e308, 1.7e308), (-1.7e308, -1.7e308), (1.5, 10**400)]
)
def test_increment_that_would_leave_the_float_range_is_not_a_number(
    start: float, by: int | float
) -> None:
    # inf has no JSON form; an int too large for a float raises OverflowError inside the sum.
    state = build({"root": ["n"]}, {"n": {"f": start}})
    assert rejected(state, NodeIncrement(node_id="n", field="f", by=by)) == "not_a_number"


def test_increment_of_big_integers_stays_exact() -> None:
    state = build({"root": ["n"]}, {"n": {"f": 2**70}})
    apply_op(state, NodeIncrement(node_id="n", field="f", by=10**30))
    assert state.nodes["n"].fields["f"] == 2**70 + 10**30


def test_increment_of_a_missing_node_is_node_not_found(tree: SubDocState) -> None:
    assert rejected(tree, NodeIncrement(node_id="ghost", field="n")) == "node_not_found"


@pytest.mark.parametrize("fields", [{}, {"n": 4}, {"n": 1.5}])
def test_increment_is_undone_exactly(fields: dict[str, JsonValue]) -> None:
    state = build({"root": ["x"]}, {"x": fields})
    applied_and_undone(state, NodeIncrement(node_id="x", field="n", by=2))


# -- undo in LIFO order --------------------------------------------------------------------------


def test_a_stack_of_undos_run_in_reverse_restores_the_start(tree: SubDocState) -> None:
    start = tree.dumps()
    ops: list[Op] = [
        NodeInsert(node_id="n", parent_id="b11"),
        NodeMove(node_id="b", parent_id="a", index=0),
        NodeUpdate(node_id="n", set={"k": 1}),
        NodeIncrement(node_id="n", field="k", by=2),
        NodeDelete(node_id="a"),
        NodeInsert(node_id="a", parent_id="root", index=0),
    ]
    undos: list[Callable[[], None]] = [apply_op(tree, op) for op in ops]
    assert set(tree.nodes) == {"root", "a", "c"}
    for undo in reversed(undos):
        undo()
    assert tree.dumps() == start
