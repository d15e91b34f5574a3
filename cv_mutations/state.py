"""Sub-doc state: an ordered tree under the fixed root `"root"` (docs/concepts.md).

The state is mutated in place by the reducers; nothing here copies the tree, because a whole-tree
copy per op is what makes a growing document slow.
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Final

from pydantic import JsonValue

__all__ = ["ROOT", "InvalidState", "Node", "SubDocState", "copy_json"]

ROOT: Final = "root"

#: How much of a state its repr shows: the first nodes (in insertion order) and, within each, the
#: first children and fields, strings cut short. A state of any size prints in a few hundred
#: characters (tests/mutations/test_state.py).
_REPR_NODES: Final = 10
_SHORT = reprlib.Repr()
_SHORT.maxlevel = 2
_SHORT.maxlist = _SHORT.maxdict = 6
_SHORT.maxstring = _SHORT.maxother = 30


class InvalidState(ValueError):
    """A serialized state that breaks the tree invariants."""


def copy_json(value: Any) -> Any:
    """A deep copy of a JSON value (dicts and lists rebuilt; scalars are immutable)."""
    if isinstance(value, dict):
        return {key: copy_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [copy_json(item) for item in value]
    return value


@dataclass(slots=True)
class Node:
    parent: str | None
    children: list[str] = field(default_factory=list)
    fields: dict[str, JsonValue] = field(default_factory=dict)


class SubDocState:
    """The nodes of one sub-doc, keyed by id. Invariants (checked by `check()`):

    every node is reachable from the root exactly once, parent and children agree, and there is
    no cycle.
    """

    __slots__ = ("nodes",)

    def __init__(self, nodes: dict[str, Node]) -> None:
        self.nodes = nodes

    @classmethod
    def empty(cls) -> SubDocState:
        return cls({ROOT: Node(parent=None)})

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        """`SubDocState(3 nodes: 'root': children=['a']; 'a': parent='root' fields={'n': 1})`,
        bounded: the first nodes, and of each the first children and fields."""
        shown = []
        for node_id in islice(self.nodes, _REPR_NODES):
            node = self.nodes[node_id]
            parts = [_SHORT.repr(node_id)]
            if node.parent is not None:
                parts.append(f"parent={_SHORT.repr(node.parent)}")
            if node.children:
                parts.append(f"children={_SHORT.repr(node.children)}")
            if node.fields:
                parts.append(f"fields={_SHORT.repr(node.fields)}")
            shown.append(parts[0] + (": " + " ".join(parts[1:]) if parts[1:] else ""))
        more = len(self.nodes) - len(shown)
        if more:
            shown.append(f"... {more} more")
        count = f"{len(self.nodes)} node" + ("" if len(self.nodes) == 1 else "s")
        return f"SubDocState({count}: {'; '.join(shown)})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SubDocState):
            return NotImplemented
        # Not `self.nodes == other.nodes`: Python's `==` holds `True == 1 == 1.0` and
        # `0.0 == -0.0`, so a cache that drifted to another JSON type (or sign of zero) than the
        # log's replay compared equal while its `dumps()` (the snapshot bytes) differed. Equal
        # states must give equal bytes (see `dumps`), so the bytes are what is compared.
        return self.dumps() == other.dumps()

    __hash__ = None  # type: ignore[assignment]  # mutable

    # -- JSON ------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The JSON form `{"nodes": {id: {"parent", "children", "fields"}}}` (copies, not views)."""
        return {
            "nodes": {
                node_id: {
                    "parent": node.parent,
                    "children": list(node.children),
                    "fields": json.loads(json.dumps(node.fields)),
                }
                for node_id, node in self.nodes.items()
            }
        }

    def dumps(self) -> str:
        """Compact, key-sorted JSON text: equal states give equal bytes."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, data: object) -> SubDocState:
        """Rebuild a state from its JSON form; raises `InvalidState` if the tree is broken."""
        if not isinstance(data, dict) or not isinstance(data.get("nodes"), dict):
            raise InvalidState('state must be {"nodes": {...}}')
        nodes: dict[str, Node] = {}
        for node_id, raw in data["nodes"].items():
            if not isinstance(raw, dict) or set(raw) != {"parent", "children", "fields"}:
                raise InvalidState(f"node {node_id!r} must have exactly parent, children, fields")
            parent, children, fields = raw["parent"], raw["children"], raw["fields"]
            if parent is not None and not isinstance(parent, str):
                raise InvalidState(f"node {node_id!r}: parent must be a string or null")
            if not isinstance(children, list) or not all(isinstance(c, str) for c in children):
                raise InvalidState(f"node {node_id!r}: children must be a list of ids")
            if not isinstance(fields, dict):
                raise InvalidState(f"node {node_id!r}: fields must be an object")
            # Deep copy: a state must share no mutable value with its input (as `to_json` shares
            # none with its output), or a caller reusing `data` would edit the state behind the
            # log's back.
            nodes[node_id] = Node(parent=parent, children=list(children), fields=copy_json(fields))
        state = cls(nodes)
        state.check()
        return state

    @classmethod
    def loads(cls, text: str | bytes) -> SubDocState:
        return cls.from_json(json.loads(text))

    # -- invariants ------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise `InvalidState` unless every node is reachable from the root exactly once."""
        root = self.nodes.get(ROOT)
        if root is None or root.parent is not None:
            raise InvalidState("the root must exist and have no parent")
        seen: set[str] = set()
        stack = [ROOT]
        while stack:
            node_id = stack.pop()
            if node_id in seen:
                raise InvalidState(f"node {node_id!r} is reachable twice (cycle or shared child)")
            seen.add(node_id)
            for child in self.nodes[node_id].children:
                child_node = self.nodes.get(child)
                if child_node is None:
                    raise InvalidState(f"child {child!r} of {node_id!r} does not exist")
                if child_node.parent != node_id:
                    raise InvalidState(f"{child!r} is under {node_id!r} but names another parent")
                stack.append(child)
        if len(seen) != len(self.nodes):
            orphans = sorted(set(self.nodes) - seen)[:5]
            raise InvalidState(f"nodes not reachable from the root: {orphans}")
