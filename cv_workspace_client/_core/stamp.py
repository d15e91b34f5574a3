"""An op's lane stamp in its stored text (docs/client.md#exactly-once), read and rewritten
without re-encoding the op: the app's bytes before the stamp stay as they are.

The SDK appends `"client_id":"<id>","seq":<n>` after the app's fields when it mints an op, so the
last occurrence of that pair is the stamp (a string value cannot hold it unescaped)."""

from __future__ import annotations

import json

__all__ = ["restamp", "stamped_seq"]


def _marker(client_id: str) -> str:
    return f',"client_id":{json.dumps(client_id)},"seq":'


def _span(op_json: str, client_id: str) -> tuple[int, int] | None:
    at = op_json.rfind(_marker(client_id))
    if at < 0:
        return None
    start = end = at + len(_marker(client_id))
    while end < len(op_json) and op_json[end].isdigit():
        end += 1
    return (start, end) if end > start else None


def stamped_seq(op_json: str, client_id: str) -> int | None:
    """The lane seq `client_id` stamped on the op, or None (not stamped by this client)."""
    span = _span(op_json, client_id)
    return None if span is None else int(op_json[span[0] : span[1]])


def restamp(op_json: str, client_id: str, seq: int) -> str:
    """The op's text with its lane seq replaced by `seq`, every other byte unchanged.

    Raises:
        ValueError: the op carries no stamp of `client_id`."""
    span = _span(op_json, client_id)
    if span is None:
        raise ValueError("the op carries no lane stamp of this client")
    return op_json[: span[0]] + str(seq) + op_json[span[1] :]
