"""SubDocState: its JSON form, and refusing any serialized state that is not a proper tree."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from cv_mutations import InvalidState, NodeInsert, SubDocState, apply_op
from tests.mutations.reference import tree_problems


def node(parent: str | None, children: list[str] | None = None, **fields: Any) -> dict[str, Any]:
    return {"parent": parent, "children": children or [], "fields": fields}


GOOD: dict[str, Any] = {
    "nodes": {
        "root": node(None, ["a", "b"]),
        "a": node("root", ["a1"], title="A", tags=["x", {"deep": None}]),
        "a1": node("a", n=1.5),
        "b": node("root"),
    }
}


def test_the_design_example_form_loads_and_dumps_back() -> None:
    state = SubDocState.from_json(GOOD)
    assert state.to_json() == GOOD
    assert state.nodes["a"].children == ["a1"]
    assert state.nodes["a1"].fields == {"n": 1.5}
    assert SubDocState.loads(state.dumps()) == state


def test_dumps_is_compact_sorted_and_equal_for_equal_states() -> None:
    one = SubDocState.from_json(GOOD)
    reordered = {"nodes": dict(reversed(list(copy.deepcopy(GOOD)["nodes"].items())))}
    other = SubDocState.from_json(reordered)
    assert one.dumps() == other.dumps()
    assert " " not in one.dumps().replace('"A"', "")
    assert one.dumps().startswith('{"nodes":{"a":')


def test_to_json_returns_copies_not_views() -> None:
    state = SubDocState.from_json(GOOD)
    exported = state.to_json()
    exported["nodes"]["a"]["children"].append("zz")
    exported["nodes"]["a"]["fields"]["tags"].append("y")
    assert state.to_json() == GOOD


def test_non_ascii_text_is_kept_as_utf8_in_dumps() -> None:
    state = SubDocState.empty()
    apply_op(state, NodeInsert(node_id="n", parent_id="root", fields={"title": "Grüße ✓"}))
    assert "Grüße ✓" in state.dumps()


def _broken(mutate: Any) -> dict[str, Any]:
    data = copy.deepcopy(GOOD)
    mutate(data["nodes"])
    return data


BROKEN = {
    "no root": _broken(lambda n: n.pop("root")),
    "root has a parent": _broken(lambda n: n["root"].update(parent="a")),
    "child listed twice": _broken(lambda n: n["root"]["children"].append("a")),
    "missing child": _broken(lambda n: n["b"]["children"].append("ghost")),
    "child names another parent": _broken(lambda n: n["a1"].update(parent="b")),
    "orphan": _broken(lambda n: n.update(o=node("root"))),
    "orphan with null parent": _broken(lambda n: n.update(o=node(None))),
    "cycle off the root": _broken(lambda n: n.update(x=node("y", ["y"]), y=node("x", ["x"]))),
    "shared child": _broken(lambda n: (n["b"]["children"].append("a1"),)),
    "root in its own subtree": _broken(lambda n: n["a1"]["children"].append("root")),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_tree_is_refused_by_from_json_and_by_the_independent_checker(case: str) -> None:
    data = BROKEN[case]
    assert tree_problems(data) != []
    with pytest.raises(InvalidState):
        SubDocState.from_json(data)


@pytest.mark.parametrize(
    "data",
    [
        None,
        [],
        {},
        {"nodes": []},
        {"nodes": {"root": {"parent": None, "children": []}}},
        {"nodes": {"root": {"parent": None, "children": [], "fields": {}, "extra": 1}}},
        {"nodes": {"root": {"parent": 5, "children": [], "fields": {}}}},
        {"nodes": {"root": {"parent": None, "children": "a", "fields": {}}}},
        {"nodes": {"root": {"parent": None, "children": [1], "fields": {}}}},
        {"nodes": {"root": {"parent": None, "children": [], "fields": []}}},
    ],
)
def test_a_malformed_state_is_refused(data: object) -> None:
    with pytest.raises(InvalidState):
        SubDocState.from_json(data)


def test_check_catches_a_tree_broken_in_memory() -> None:
    state = SubDocState.from_json(GOOD)
    state.check()
    state.nodes["b"].children.append("a1")
    with pytest.raises(InvalidState):
        state.check()


def test_states_compare_by_content() -> None:
    assert SubDocState.from_json(GOOD) == SubDocState.from_json(copy.deepcopy(GOOD))
    assert SubDocState.from_json(GOOD) != SubDocState.empty()
    assert SubDocState.empty() != object()


# -- repr -----------------------------------------------------------------------------------------


def test_a_state_prints_its_nodes_their_tree_and_fields() -> None:
    shown = repr(SubDocState.from_json(GOOD))
    assert shown.startswith("SubDocState(4 nodes: ")
    assert "'root': children=['a', 'b']" in shown
    assert "'a1': parent='a' fields={'n': 1.5}" in shown
    assert str(SubDocState.from_json(GOOD)) == shown  # print(state) shows the same
    assert repr(SubDocState.empty()) == "SubDocState(1 node: 'root')"


def test_the_repr_of_a_huge_state_is_bounded() -> None:
    # 100k nodes under the root, one with a long list and a long string: a few hundred
    # characters, never one line per node.
    state = SubDocState.empty()
    for i in range(100_000):
        apply_op(state, NodeInsert(node_id=f"n{i}", parent_id="root"))
    state.nodes["n0"].fields.update(big=list(range(10_000)), text="x" * 100_000)
    shown = repr(state)
    assert shown.startswith("SubDocState(100001 nodes: 'root': children=['n0', 'n1', ")
    assert shown.endswith("; ... 99991 more)")  # the first 10 nodes shown
    assert len(shown) < 1_000, len(shown)
