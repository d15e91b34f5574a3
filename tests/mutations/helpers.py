"""Small helpers shared by the reducer property tests."""

from __future__ import annotations

from cv_mutations import NodeInsert, Op, OpRejected, SubDocState, apply_op

__all__ = ["outcome", "start_state"]


def start_state(start: list[NodeInsert]) -> SubDocState:
    """The state built by applying `start` to an empty sub-doc."""
    state = SubDocState.empty()
    for insert in start:
        apply_op(state, insert)
    return state


def outcome(state: SubDocState, op: Op) -> str | None:
    """Apply `op`; its rejection code, or None when it applied."""
    try:
        apply_op(state, op)
    except OpRejected as rejection:
        return rejection.code
    return None
