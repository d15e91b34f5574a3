"""What the chaos writers intend: an unbounded, deterministic plan per writer.

Op `k` of writer `w` has the op_id `chaos-w<w>-<k>` and goes to sub-doc `DOCS[k % 3]`. Per
sub-doc, two folders and a leaf are inserted first, then the leaf moves between the folders
(every 4th op) and the shared counter is incremented: an op applied out of order is rejected
(`node_not_found`), and one applied twice shows in the counter (`node.increment` is not
idempotent). A restarted writer re-intends an op its predecessor never got into the outbox under
the same identity, so "intended by writer w" is the prefix `0..k` of its plan.
"""

from __future__ import annotations

from typing import Any, Final

__all__ = ["DOCS", "WS", "op_for", "op_id_of", "parse_op_id"]

WS: Final = "chaos"
DOCS: Final = ("d0", "d1", "d2")
_PREFIX: Final = "chaos-w"


def op_id_of(writer: int, k: int) -> str:
    return f"{_PREFIX}{writer}-{k:07d}"


def parse_op_id(op_id: str | None) -> tuple[int, int] | None:
    """(writer, k) of a writer's op_id; None for any other op."""
    if op_id is None or not op_id.startswith(_PREFIX):
        return None
    writer, _, k = op_id.removeprefix(_PREFIX).partition("-")
    return int(writer), int(k)


def op_for(writer: int, k: int) -> tuple[str, dict[str, Any]]:
    """Writer `writer`'s op `k`: (sub-doc, op as JSON)."""
    doc, j = DOCS[k % len(DOCS)], k // len(DOCS)
    a, b, leaf = f"w{writer}.a", f"w{writer}.b", f"w{writer}.x"
    op: dict[str, Any]
    if j == 0:
        op = {"type": "node.insert", "node_id": a, "parent_id": "root"}
    elif j == 1:
        op = {"type": "node.insert", "node_id": b, "parent_id": "root"}
    elif j == 2:
        op = {"type": "node.insert", "node_id": leaf, "parent_id": a}
    elif j % 4 == 3:
        target = b if (j // 4) % 2 == 0 else a
        op = {"type": "node.move", "node_id": leaf, "parent_id": target, "index": 0}
    else:
        op = {"type": "node.increment", "node_id": "counter", "field": "n", "by": 1}
    op["op_id"] = op_id_of(writer, k)
    return doc, op
