"""What the SDK hands back: `Commit` (the answer to an op), `Committed` (an op a subscription saw).

Pure value types: the sans-I/O core builds them.
"""

from __future__ import annotations

from dataclasses import dataclass

from cv_mutations import Op

__all__ = ["Commit", "Committed"]


@dataclass(frozen=True, slots=True)
class Commit:
    """The server committed the op at `clock` of its sub-doc.

    `duplicate` is true when this answer is a replay: an earlier send of the same `op_id` had
    already been committed (its answer was lost, or another process replayed the outbox). The op
    was applied once either way.
    """

    clock: int
    op_id: str
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class Committed:
    """One committed op of a subscribed sub-doc, in clock order, each clock exactly once."""

    clock: int
    op_id: str | None
    op: Op
