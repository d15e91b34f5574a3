"""An independent reading of docs/ops.md to hold the real code against.

Both functions work on the JSON form of a state (`{"nodes": {...}}`) and share no code with
`cv_mutations.state` or `cv_mutations.reducers`: they are written the slow, obvious way (whole-tree
walks, copies) so that a bug in the fast in-place reducers or in `SubDocState.check()` cannot hide
behind the same bug here.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from cv_mutations import NodeDelete, NodeIncrement, NodeInsert, NodeMove, NodeUpdate, Op

ROOT = "root"

JsonState = dict[str, Any]


def tree_problems(state: JsonState) -> list[str]:
    """Every way `state` breaks the tree invariants; empty when it is a proper ordered tree."""
    nodes: dict[str, Any] = state["nodes"]
    problems: list[str] = []
    if ROOT not in nodes:
        return ["no root"]
    if nodes[ROOT]["parent"] is not None:
        problems.append("the root has a parent")
    # parent -> children agreement, seen from both sides.
    for node_id, node in nodes.items():
        children = node["children"]
        if len(children) != len(set(children)):
            problems.append(f"{node_id} lists a child twice")
        for child in children:
            if child not in nodes:
                problems.append(f"{node_id} lists missing child {child}")
            elif nodes[child]["parent"] != node_id:
                problems.append(
                    f"{child} is listed by {node_id} but names {nodes[child]['parent']}"
                )
        if node_id != ROOT:
            parent = node["parent"]
            if parent not in nodes:
                problems.append(f"{node_id} names missing parent {parent}")
            elif nodes[parent]["children"].count(node_id) != 1:
                problems.append(f"{node_id} is not listed exactly once by its parent {parent}")
    # Every node reaches the root by parent links within len(nodes) steps: no cycle.
    for node_id in nodes:
        cursor: str | None = node_id
        for _ in range(len(nodes) + 1):
            if cursor is None or cursor not in nodes:
                break
            cursor = nodes[cursor]["parent"]
        if cursor is not None:
            problems.append(f"{node_id} does not reach the root (cycle or dangling parent)")
    # Breadth-first from the root visits every node exactly once.
    order = [ROOT]
    for node_id in order:
        if len(order) > len(nodes):
            problems.append("walking down from the root never ends (cycle)")
            break
        order.extend(c for c in nodes[node_id]["children"] if c in nodes)
    else:
        if sorted(order) != sorted(nodes):
            problems.append("the walk from the root does not visit every node exactly once")
    return problems


def _subtree(nodes: dict[str, Any], node_id: str) -> list[str]:
    found = [node_id]
    for current in found:
        found.extend(nodes[current]["children"])
    return found


def reference_apply(state: JsonState, op: Op) -> tuple[JsonState, str | None]:
    """(new state, None) when `op` applies, or (the same state, rejection code) when it does not.

    The precedence of codes follows the reducers' documented order: existence of the node
    (or root_immutable first for move/delete), then the parent, then cycle, then the index.
    """
    nodes: dict[str, Any] = state["nodes"]
    if isinstance(op, NodeInsert):
        if op.node_id in nodes:
            return state, "node_exists"
        if op.parent_id not in nodes:
            return state, "parent_not_found"
        count = len(nodes[op.parent_id]["children"])
        index = count if op.index is None else op.index
        if index > count:
            return state, "index_out_of_range"
        new = copy.deepcopy(state)
        new["nodes"][op.parent_id]["children"].insert(index, op.node_id)
        new["nodes"][op.node_id] = {
            "parent": op.parent_id,
            "children": [],
            "fields": copy.deepcopy(op.fields),
        }
        return new, None
    if isinstance(op, NodeMove):
        if op.node_id == ROOT:
            return state, "root_immutable"
        if op.node_id not in nodes:
            return state, "node_not_found"
        if op.parent_id not in nodes:
            return state, "parent_not_found"
        if op.parent_id in _subtree(nodes, op.node_id):
            return state, "cycle"
        new = copy.deepcopy(state)
        new_nodes = new["nodes"]
        new_nodes[new_nodes[op.node_id]["parent"]]["children"].remove(op.node_id)
        target = new_nodes[op.parent_id]["children"]
        if op.index > len(target):
            return state, "index_out_of_range"
        target.insert(op.index, op.node_id)
        new_nodes[op.node_id]["parent"] = op.parent_id
        return new, None
    if isinstance(op, NodeDelete):
        if op.node_id == ROOT:
            return state, "root_immutable"
        if op.node_id not in nodes:
            return state, "node_not_found"
        new = copy.deepcopy(state)
        new_nodes = new["nodes"]
        new_nodes[new_nodes[op.node_id]["parent"]]["children"].remove(op.node_id)
        for gone in _subtree(new_nodes, op.node_id):
            del new_nodes[gone]
        return new, None
    if isinstance(op, NodeUpdate):
        if op.node_id not in nodes:
            return state, "node_not_found"
        new = copy.deepcopy(state)
        fields = new["nodes"][op.node_id]["fields"]
        fields.update(copy.deepcopy(op.set))
        for name in op.unset:
            fields.pop(name, None)
        return new, None
    if isinstance(op, NodeIncrement):
        if op.node_id not in nodes:
            return state, "node_not_found"
        current = nodes[op.node_id]["fields"].get(op.field, 0)
        if type(current) not in (int, float):
            return state, "not_a_number"
        try:
            total = current + op.by
        except OverflowError:
            return state, "not_a_number"
        if isinstance(total, float) and not math.isfinite(total):
            return state, "not_a_number"
        new = copy.deepcopy(state)
        new["nodes"][op.node_id]["fields"][op.field] = total
        return new, None
    raise AssertionError(f"unknown op {op!r}")
