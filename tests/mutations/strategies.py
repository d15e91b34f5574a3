"""Hypothesis strategies for ops, JSON values and op sequences.

Strategies are built once at import and reused: building them inside a draw costs Hypothesis far
more than the reducers cost to run.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from cv_mutations import (
    NodeDelete,
    NodeIncrement,
    NodeInsert,
    NodeMove,
    NodeUpdate,
    Op,
    SubDocState,
)
from cv_mutations.ids import NANOID_ALPHABET

NODE_ID_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:-"

# -- the whole valid range of every field --------------------------------------------------------

node_ids = st.text(alphabet=NODE_ID_ALPHABET, min_size=1, max_size=128)
op_ids = st.text(alphabet=NANOID_ALPHABET, min_size=8, max_size=64)
field_names = st.text(min_size=1, max_size=128)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values: st.SearchStrategy[Any] = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
json_objects = st.dictionaries(field_names, json_values, max_size=3)
metas: st.SearchStrategy[Any] = st.none() | st.dictionaries(
    st.text(max_size=10), json_scalars, max_size=3
)
indexes = st.integers(min_value=0, max_value=2**31)
numbers = st.integers(min_value=-(2**53), max_value=2**53) | st.floats(
    allow_nan=False, allow_infinity=False
)


def updates(
    node_id: st.SearchStrategy[str],
    names: st.SearchStrategy[str],
    values: st.SearchStrategy[Any] = json_values,
    envelope: bool = True,
) -> st.SearchStrategy[NodeUpdate]:
    """NodeUpdate ops; names drawn for `unset` that are also in `set` are dropped (disjoint)."""
    return st.builds(
        lambda node, to_set, to_unset, op_id, meta: NodeUpdate(
            node_id=node,
            set=to_set,
            unset=[name for name in to_unset if name not in to_set],
            op_id=op_id,
            meta=meta,
        ),
        node_id,
        st.dictionaries(names, values, max_size=3),
        st.lists(names, max_size=3),
        st.none() | op_ids if envelope else st.none(),
        metas if envelope else st.none(),
    )


#: Any well-formed op, with ids and values drawn from their whole valid range.
any_ops: st.SearchStrategy[Op] = st.one_of(
    st.builds(
        NodeInsert,
        node_id=node_ids,
        parent_id=node_ids,
        index=st.none() | indexes,
        fields=json_objects,
        op_id=st.none() | op_ids,
        meta=metas,
    ),
    st.builds(
        NodeMove,
        node_id=node_ids,
        parent_id=node_ids,
        index=indexes,
        op_id=st.none() | op_ids,
        meta=metas,
    ),
    st.builds(NodeDelete, node_id=node_ids, op_id=st.none() | op_ids, meta=metas),
    updates(node_ids, field_names),
    st.builds(
        NodeIncrement,
        node_id=node_ids,
        field=field_names,
        by=numbers,
        op_id=st.none() | op_ids,
        meta=metas,
    ),
)

# -- ops over a small pool of ids, so sequences keep meeting the same nodes ----------------------

#: Ids that start in the tree (see `pool_trees`) and ids that start out of it.
NODE_POOL = ("root", "a", "b", "c", "d", "e", "f", "g")
ABSENT_POOL = ("h", "i", "ghost")
FIELD_POOL = ("n", "title", "flag", "x")

_pool_ids = st.sampled_from(NODE_POOL + ABSENT_POOL)
_pool_fields = st.sampled_from(FIELD_POOL)
_small_indexes = st.integers(min_value=0, max_value=5)
# Field values that make later increments both apply and hit not_a_number (bools, strings),
# and a float near the top of the range so a sum can overflow.
_pool_values = st.one_of(
    st.integers(min_value=-5, max_value=5),
    st.floats(min_value=-1e3, max_value=1e3),
    st.booleans(),
    st.text(max_size=3),
    st.none(),
    st.just(1.7e308),
)
_pool_field_maps = st.dictionaries(_pool_fields, _pool_values, max_size=3)
_steps = st.integers(min_value=-3, max_value=3) | st.sampled_from([0.5, 1.7e308])


def _inserts_for(shape: tuple[tuple[int, int | None, dict[str, Any]], ...]) -> list[NodeInsert]:
    inserts: list[NodeInsert] = []
    placed = ["root"]
    for node_id, (parent_pick, index_pick, fields) in zip(NODE_POOL[1:], shape, strict=True):
        parent = placed[parent_pick]
        siblings = len([op for op in inserts if op.parent_id == parent])
        index = None if index_pick is None else min(index_pick, siblings)
        inserts.append(NodeInsert(node_id=node_id, parent_id=parent, index=index, fields=fields))
        placed.append(node_id)
    return inserts


#: Inserts that build a random tree of every id of NODE_POOL, each under an earlier one. The
#: fields hold numbers and non-numbers alike.
pool_trees: st.SearchStrategy[list[NodeInsert]] = st.tuples(
    *(
        st.tuples(
            st.integers(min_value=0, max_value=position),
            st.none() | st.integers(min_value=0, max_value=6),
            _pool_field_maps,
        )
        for position in range(len(NODE_POOL) - 1)
    )
).map(_inserts_for)

_pool_move = st.builds(NodeMove, node_id=_pool_ids, parent_id=_pool_ids, index=_small_indexes)

#: Blind ops over the pool: valid and invalid, on existing and missing nodes. Run over a start
#: tree holding most of the pool, deletes take subtrees and moves meet cycles.
pool_ops: st.SearchStrategy[Op] = st.one_of(
    st.builds(
        NodeInsert,
        node_id=_pool_ids,
        parent_id=_pool_ids,
        index=st.none() | _small_indexes,
        fields=_pool_field_maps,
    ),
    # Moves have the most ways to go wrong (cycles, same-parent indexes): drawn twice as often.
    _pool_move,
    _pool_move,
    st.builds(NodeDelete, node_id=_pool_ids),
    updates(_pool_ids, _pool_fields, _pool_values, envelope=False),
    st.builds(NodeIncrement, node_id=_pool_ids, field=_pool_fields, by=_steps),
)

#: (the inserts that build a start tree, then random ops over the pool of ids).
op_sequences = st.tuples(pool_trees, st.lists(pool_ops, min_size=1, max_size=40))

# -- ops aimed at the live state -----------------------------------------------------------------

#: Moves listed twice: they have the most edges (cycles, same-parent indexes, the root).
OP_KINDS = ("node.insert", "node.move", "node.move", "node.delete", "node.update", "node.increment")
_kinds = st.sampled_from(OP_KINDS)
_maybe = st.booleans()
_update_bodies = updates(st.just("_"), _pool_fields, _pool_values, envelope=False)


def aimed_op(data: st.DataObject, state: SubDocState) -> Op:
    """An op aimed at the live state: ids mostly of existing nodes, indexes around the boundary.

    Blind ops (pool_ops) rarely hit exact edges such as "move within the same parent to the slot
    just past the end"; drawing against the current children makes every edge common.
    """
    draw = data.draw
    targets = st.sampled_from([*sorted(state.nodes), "ghost"])
    node_id = draw(targets)
    parent_id = draw(targets)
    parent = state.nodes.get(parent_id)
    count = len(parent.children) if parent is not None else 0
    index = draw(st.integers(min_value=0, max_value=count + 1))
    kind = draw(_kinds)
    if kind == "node.insert":
        fresh = draw(st.sampled_from([*ABSENT_POOL, node_id]))
        return NodeInsert(
            node_id=fresh,
            parent_id=parent_id,
            index=index if draw(_maybe) else None,
            fields=draw(_pool_field_maps),
        )
    if kind == "node.move":
        return NodeMove(node_id=node_id, parent_id=parent_id, index=index)
    if kind == "node.delete":
        return NodeDelete(node_id=node_id)
    if kind == "node.update":
        return draw(_update_bodies).model_copy(update={"node_id": node_id})
    return NodeIncrement(node_id=node_id, field=draw(_pool_fields), by=draw(_steps))
