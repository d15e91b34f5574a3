"""Pure reducers: `apply_op(state, op)` (docs/ops.md).

Every reducer validates fully before it mutates anything, so a rejected op leaves the state
exactly as it was. Each op costs O(depth + siblings) (a delete also pays for its subtree); nothing
walks or copies the whole tree.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final

from pydantic import JsonValue

from cv_mutations.envelope import json_size
from cv_mutations.ops import NodeDelete, NodeIncrement, NodeInsert, NodeMove, NodeUpdate, Op
from cv_mutations.state import ROOT, Node, SubDocState, copy_json

__all__ = ["REJECTION_CODES", "OpRejected", "Undo", "apply_op"]

#: The rejection codes (docs/ops.md#rejection-codes). A rejected op consumes no clock and is
#: recorded as-is.
REJECTION_CODES: Final = frozenset(
    {
        "node_exists",
        "node_not_found",
        "parent_not_found",
        "index_out_of_range",
        "cycle",
        "root_immutable",
        "not_a_number",
    }
)

#: Reverts the op it was returned for. Undo in LIFO order only (the server uses it to roll an
#: `atomic` batch or a failed transaction back out of its in-memory state).
Undo = Callable[[], None]


class OpRejected(Exception):
    """The op is well-formed but does not fit the current state. `code` is in REJECTION_CODES."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _node(state: SubDocState, node_id: str, code: str = "node_not_found") -> Node:
    node = state.nodes.get(node_id)
    if node is None:
        raise OpRejected(code, f"node {node_id!r} does not exist")
    return node


def _insert(state: SubDocState, op: NodeInsert) -> Undo:
    nodes = state.nodes
    if op.node_id in nodes:
        raise OpRejected("node_exists", f"node {op.node_id!r} already exists")
    parent = _node(state, op.parent_id, "parent_not_found")
    siblings = parent.children
    index = len(siblings) if op.index is None else op.index
    if index > len(siblings):
        raise OpRejected("index_out_of_range", f"index {index} > {len(siblings)} children")
    # A deep copy: pydantic keeps the caller's nested lists and dicts inside a (frozen) op, so a
    # shallow copy let a caller who edits them after the apply edit the state too.
    nodes[op.node_id] = Node(parent=op.parent_id, children=[], fields=copy_json(op.fields))
    siblings.insert(index, op.node_id)

    def undo() -> None:
        del siblings[index]
        del nodes[op.node_id]

    return undo


def _move(state: SubDocState, op: NodeMove) -> Undo:
    if op.node_id == ROOT:
        raise OpRejected("root_immutable", "the root cannot be moved")
    node = _node(state, op.node_id)
    new_parent = _node(state, op.parent_id, "parent_not_found")
    # A cycle exists iff the node is the new parent or one of its ancestors: O(depth).
    cursor: str | None = op.parent_id
    while cursor is not None:
        if cursor == op.node_id:
            raise OpRejected("cycle", f"{op.parent_id!r} is {op.node_id!r} or inside its subtree")
        cursor = state.nodes[cursor].parent
    old_parent_id = node.parent
    assert old_parent_id is not None  # only the root has no parent
    old_siblings = state.nodes[old_parent_id].children
    old_index = old_siblings.index(op.node_id)
    room = len(new_parent.children) - (1 if old_parent_id == op.parent_id else 0)
    if op.index > room:
        raise OpRejected("index_out_of_range", f"index {op.index} > {room} children")
    del old_siblings[old_index]
    new_parent.children.insert(op.index, op.node_id)
    node.parent = op.parent_id

    def undo() -> None:
        del new_parent.children[op.index]
        old_siblings.insert(old_index, op.node_id)
        node.parent = old_parent_id

    return undo


def _delete(state: SubDocState, op: NodeDelete) -> Undo:
    if op.node_id == ROOT:
        raise OpRejected("root_immutable", "the root cannot be deleted")
    node = _node(state, op.node_id)
    assert node.parent is not None
    nodes = state.nodes
    siblings = nodes[node.parent].children
    index = siblings.index(op.node_id)
    removed: list[tuple[str, Node]] = []
    stack = [op.node_id]
    while stack:
        node_id = stack.pop()
        removed_node = nodes.pop(node_id)
        removed.append((node_id, removed_node))
        stack.extend(removed_node.children)
    del siblings[index]

    def undo() -> None:
        for node_id, removed_node in removed:
            nodes[node_id] = removed_node
        siblings.insert(index, op.node_id)

    return undo


_MISSING: Final = object()


def _update(state: SubDocState, op: NodeUpdate) -> Undo:
    fields = _node(state, op.node_id).fields
    before = {key: fields.get(key, _MISSING) for key in (*op.set, *op.unset)}
    # Deep copies, for the same reason as in `_insert`.
    fields.update({key: copy_json(value) for key, value in op.set.items()})
    for key in op.unset:
        fields.pop(key, None)

    def undo() -> None:
        for key, value in before.items():
            if value is _MISSING:
                fields.pop(key, None)
            else:
                fields[key] = value  # type: ignore[assignment]

    return undo


def _increment(state: SubDocState, op: NodeIncrement) -> Undo:
    fields = _node(state, op.node_id).fields
    current: JsonValue = fields.get(op.field, 0)
    # bool is an int subclass in Python but not a number in JSON.
    if isinstance(current, bool) or not isinstance(current, int | float):
        raise OpRejected("not_a_number", f"field {op.field!r} holds {type(current).__name__}")
    try:
        total = current + op.by
    except OverflowError:  # a float plus an int beyond float range
        total = math.inf
    # Two finite floats can still sum to inf, which has no JSON form; the field is left as it was.
    if isinstance(total, float) and not math.isfinite(total):
        raise OpRejected("not_a_number", f"field {op.field!r} would leave the float range")
    # Likewise two integers that each have a JSON text can sum to one digit more than Python
    # writes (sys.get_int_max_str_digits): applied, the state's dumps() raised ValueError.
    if isinstance(total, int) and total.bit_length() > 64:
        try:
            json_size(total)
        except ValueError:
            raise OpRejected(
                "not_a_number", f"field {op.field!r} would have too many digits for JSON text"
            ) from None
    had = op.field in fields
    fields[op.field] = total

    def undo() -> None:
        if had:
            fields[op.field] = current
        else:
            del fields[op.field]

    return undo


_REDUCERS: Final[dict[type, Callable[[SubDocState, Op], Undo]]] = {
    NodeInsert: _insert,  # type: ignore[dict-item]
    NodeMove: _move,  # type: ignore[dict-item]
    NodeDelete: _delete,  # type: ignore[dict-item]
    NodeUpdate: _update,  # type: ignore[dict-item]
    NodeIncrement: _increment,  # type: ignore[dict-item]
}


def apply_op(state: SubDocState, op: Op) -> Undo:
    """Apply `op` to `state` in place and return a function that reverts it.

    Raises `OpRejected` (state untouched) when the op does not fit the state.
    """
    return _REDUCERS[type(op)](state, op)
