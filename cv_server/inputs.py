"""Validation of what clients send, shared by HTTP and the websocket (DESIGN §11).

Everything is checked before anything is applied: one bad op refuses the whole request.
"""

from __future__ import annotations

from typing import Any

import orjson

from cv_mutations import InvalidOp, fingerprint, is_valid_sub_doc, is_valid_workspace_id, parse_op
from cv_server.oplog import IncomingOp
from cv_server.problems import Problem

__all__ = ["check_ids", "decode_json", "parse_apply_body", "parse_ops"]


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


def parse_ops(raw_ops: object, max_ops: int) -> list[IncomingOp]:
    if not isinstance(raw_ops, list):
        raise Problem(400, "malformed_json", '"ops" must be a list')
    if len(raw_ops) > max_ops:
        raise Problem(422, "too_many_ops", f"{len(raw_ops)} ops; at most {max_ops} per request")
    incoming: list[IncomingOp] = []
    for index, raw in enumerate(raw_ops):
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
