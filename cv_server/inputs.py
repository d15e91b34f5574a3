"""Validation of what clients send, shared by HTTP and the websocket (DESIGN §11).

Everything is checked before anything is applied: one bad op refuses the whole request.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from cv_mutations import InvalidOp, fingerprint, is_valid_sub_doc, is_valid_workspace_id, parse_op
from cv_server.oplog import IncomingOp
from cv_server.problems import Problem

__all__ = ["MAX_CLOCK", "check_ids", "check_since", "decode_json", "parse_apply_body", "parse_ops"]

#: The largest clock a client may name (`since`): far below SQLite's INTEGER range, past which a
#: read would fail inside the store instead of answering `invalid_field`.
MAX_CLOCK: Final = 2**62


def check_ids(workspace_id: str, sub_doc: str | None = None) -> None:
    if not is_valid_workspace_id(workspace_id):
        raise Problem(422, "invalid_id", "workspace_id must match [A-Za-z0-9_-]{1,64}")
    if sub_doc is not None and not is_valid_sub_doc(sub_doc):
        raise Problem(422, "invalid_id", "sub_doc must match [a-z0-9_.-]{1,64}")


def decode_json(raw: bytes | str) -> Any:
    """Strict JSON (orjson: no NaN or Infinity, which `json.loads` would let through into the
    log as invalid JSON), about five times faster than the standard library."""
    try:
        return orjson.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Problem(400, "malformed_json", f"body is not valid JSON: {exc}") from None


def check_since(since: object) -> int:
    """A websocket `since`: an integer clock in [0, MAX_CLOCK] (what HTTP `?since=` accepts)."""
    if not isinstance(since, int) or isinstance(since, bool) or not 0 <= since <= MAX_CLOCK:
        raise Problem(400, "invalid_field", f"since must be an integer between 0 and {MAX_CLOCK}")
    return since


def _encodes_as_frame(raw: object) -> bool:
    """True if `raw` can be written to the log and broadcast inside an `op` frame.

    orjson reads JSON nested up to 1024 levels deep but writes at most 255, and pydantic accepts
    ops a few levels short of that: an op nested just under pydantic's limit was committed, then
    could not be encoded as the `op` frame (one level more), so the HTTP caller got a 500 for a
    committed op and every catch-up over it failed (close 1011) for good; a level deeper and the
    log write itself failed with 500 `internal`, which clients retry. Checked before anything is
    applied, with the frame's own extra level, so such an op is a 422 like any bad field.
    """
    try:
        orjson.dumps({"op": raw})
    except orjson.JSONEncodeError:
        return False
    return True


def parse_ops(raw_ops: object, max_ops: int) -> list[IncomingOp]:
    if not isinstance(raw_ops, list):
        raise Problem(400, "malformed_json", '"ops" must be a list')
    if len(raw_ops) > max_ops:
        raise Problem(422, "too_many_ops", f"{len(raw_ops)} ops; at most {max_ops} per request")
    incoming: list[IncomingOp] = []
    for index, raw in enumerate(raw_ops):
        if not _encodes_as_frame(raw):
            raise Problem(422, "invalid_field", "the op is nested too deeply", op_index=index)
        try:
            op = parse_op(raw)
        except InvalidOp as exc:
            raise Problem(422, exc.code, exc.message, op_index=index) from None
        assert isinstance(raw, dict)  # parse_op refuses anything else
        incoming.append(IncomingOp(op=op, raw=raw, fingerprint=fingerprint(raw)))
    return incoming


def parse_apply_body(body: object, max_ops: int) -> tuple[list[IncomingOp], bool]:
    """`{"ops": [...], "atomic"?: bool}` → (ops, atomic)."""
    if not isinstance(body, dict):
        raise Problem(400, "malformed_json", 'body must be an object {"ops": [...]}')
    unknown = set(body) - {"ops", "atomic"}
    if unknown:
        raise Problem(400, "malformed_json", f"unknown members: {sorted(unknown)}")
    atomic = body.get("atomic", False)
    if not isinstance(atomic, bool):
        raise Problem(400, "malformed_json", '"atomic" must be a boolean')
    return parse_ops(body.get("ops"), max_ops), atomic
