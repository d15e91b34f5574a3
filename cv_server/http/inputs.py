"""Validation of what clients send, shared by HTTP and the websocket (docs/problems.md).

Everything is checked before anything is applied: one bad op refuses the whole request.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Final

import orjson

from cv_mutations import InvalidOp, fingerprint, is_valid_sub_doc, is_valid_workspace_id, parse_op
from cv_server.config import ServerConfig
from cv_server.http.problems import Problem
from cv_server.oplog import IncomingOp

__all__ = [
    "MAX_CLOCK",
    "ApplyRequest",
    "check_ids",
    "check_since",
    "decode_json",
    "latest_minted_at",
    "parse_apply",
    "parse_apply_body",
    "parse_ops",
]

#: The largest clock a client may name (`since`): far below SQLite's INTEGER range, past which a
#: read would fail inside the store instead of answering `invalid_field`.
MAX_CLOCK: Final = 2**62


def check_ids(workspace_id: str, sub_doc: str | None = None) -> None:
    if not is_valid_workspace_id(workspace_id):
        raise Problem(422, "invalid_id", "workspace_id must match [A-Za-z0-9_-]{1,64}")
    if sub_doc is not None and not is_valid_sub_doc(sub_doc):
        raise Problem(422, "invalid_id", "sub_doc must match [a-z0-9_.-]{1,64}")


#: A run of digits as long as the shortest integer orjson cannot read exactly (2**64 has 20;
#: -(2**63) - 1 has 19 after its sign). Seen anywhere (in a string too), the body is read again.
#: Found by mapping every digit to "0" and every other byte to " ": a C-speed pass, less than
#: half a regular expression's cost per websocket message.
_LONG_DIGITS: Final = b"0" * 19
_DIGITS_ONLY: Final = bytes(0x30 if 0x30 <= byte <= 0x39 else 0x20 for byte in range(256))


def decode_json(raw: bytes | str) -> Any:
    """Strict JSON (orjson: no NaN or Infinity, which `json.loads` would let through into the
    log as invalid JSON), about five times faster than the standard library.

    orjson reads an integer past 64 bits as a float: `"by": 123456789012345678901234567890`
    (which the SDK sends digit for digit) was committed as `1.2345678901234568e+29`, a value
    the caller never sent. Where a long run of digits appears, the text (already known to be
    valid JSON) is read again by the standard library, which keeps such integers exact, and
    the op carrying one is refused by `parse_ops` (the log cannot encode it)."""
    try:
        value = orjson.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Problem(400, "malformed_json", f"body is not valid JSON: {exc}") from None
    text = raw.encode() if isinstance(raw, str) else raw
    if _LONG_DIGITS not in text.translate(_DIGITS_ONLY):
        return value
    try:
        return json.loads(raw)
    except RecursionError:  # nested past the standard library's reach: not an op anyway
        return value


def check_since(since: object) -> int:
    """A websocket `since`: an integer clock in [0, MAX_CLOCK] (what HTTP `?since=` accepts)."""
    if not isinstance(since, int) or isinstance(since, bool) or not 0 <= since <= MAX_CLOCK:
        raise Problem(400, "invalid_field", f"since must be an integer between 0 and {MAX_CLOCK}")
    return since


def _frame_problem(raw: object) -> str | None:
    """Why `raw` cannot be written to the log and broadcast inside an `op` frame, if it cannot.

    orjson reads JSON nested up to 1024 levels deep but writes at most 255, and pydantic accepts
    ops a few levels short of that: an op nested just under pydantic's limit was committed, then
    could not be encoded as the `op` frame (one level more), so the HTTP caller got a 500 for a
    committed op and every catch-up over it failed (close 1011) for good; a level deeper and the
    log write itself failed with 500 `internal`, which clients retry. Checked before anything is
    applied, with the frame's own extra level, so such an op is a 422 like any bad field.
    The same for an integer past 64 bits (`decode_json` keeps it exact), which orjson cannot
    write either.
    """
    try:
        orjson.dumps({"op": raw})
    except orjson.JSONEncodeError as exc:
        if "64-bit" in str(exc):
            return "integers must fit in 64 bits (-2**63 .. 2**64-1)"
        return "the op is nested too deeply"
    return None


def latest_minted_at(config: ServerConfig) -> int:
    """The latest `minted_at` (unix ms) taken now: the server's clock plus the allowed skew."""
    return int((time.time() + config.minted_at_skew_seconds) * 1000)


def parse_ops(
    raw_ops: object, max_ops: int, latest_minted_at: int | None = None
) -> list[IncomingOp]:
    """The ops of a batch, each parsed; 4xx problem naming the first bad op (`op_index`).

    `latest_minted_at` (unix ms: the server's now plus `minted_at_skew_seconds`): an op without
    a lane dated later is refused `invalid_field`. Its date is what proves its age once its
    record is compacted (docs/ops.md#exactly-once), so a date from the future is not taken.
    A lane op is not refused for its date here: one from the future is judged in the
    pipeline, where only an op at or below its mark reads it."""
    if not isinstance(raw_ops, list):
        raise Problem(400, "malformed_json", '"ops" must be a list')
    if not raw_ops:  # the schema's minItems (tests/server/http/test_inputs.py)
        raise Problem(422, "invalid_field", '"ops" must hold at least one op')
    if len(raw_ops) > max_ops:
        raise Problem(422, "too_many_ops", f"{len(raw_ops)} ops; at most {max_ops} per request")
    incoming: list[IncomingOp] = []
    for index, raw in enumerate(raw_ops):
        problem = _frame_problem(raw)
        if problem is not None:
            raise Problem(422, "invalid_field", problem, op_index=index)
        try:
            op = parse_op(raw)
        except InvalidOp as exc:
            raise Problem(422, exc.code, exc.message, op_index=index) from None
        assert isinstance(raw, dict)  # parse_op refuses anything else
        if (
            latest_minted_at is not None
            and op.seq is None
            and op.minted_at is not None
            and op.minted_at > latest_minted_at
        ):
            raise Problem(
                422,
                "invalid_field",
                "minted_at is in the future by more than the allowed clock skew",
                op_index=index,
            )
        incoming.append(IncomingOp(op=op, raw=raw, fingerprint=fingerprint(raw)))
    return incoming


@dataclass(frozen=True, slots=True)
class ApplyRequest:
    """An apply as the op-log routes take it (docs/protocol.md): the ops, `atomic`, and the
    clock the write is based on (`if_clock`, None: unconditional)."""

    ops: list[IncomingOp]
    atomic: bool = False
    if_clock: int | None = None
    #: `enqueue` as sent (None: absent), read by the route (`cv_server.http.queue.apply_enqueue`).
    enqueue: object = None


def parse_apply(body: object, max_ops: int, latest_minted_at: int | None = None) -> ApplyRequest:
    """`{"ops": [...], "atomic"?: bool, "if_clock"?: int, "enqueue"?: [...]}` → `ApplyRequest`;
    `latest_minted_at` as `parse_ops`. Raises `Problem` (nothing applied) on any bad member."""
    if_clock = body.get("if_clock") if isinstance(body, dict) else None
    enqueue = body.get("enqueue") if isinstance(body, dict) else None
    rest = (
        {k: v for k, v in body.items() if k not in ("if_clock", "enqueue")}
        if isinstance(body, dict)
        else body
    )
    ops, atomic = parse_apply_body(rest, max_ops, latest_minted_at)
    if if_clock is not None and (
        not isinstance(if_clock, int)
        or isinstance(if_clock, bool)
        or not 0 <= if_clock <= MAX_CLOCK
    ):
        raise Problem(
            422, "invalid_field", f'"if_clock" must be an integer between 0 and {MAX_CLOCK}'
        )
    return ApplyRequest(ops, atomic, if_clock, enqueue)


def parse_apply_body(
    body: object, max_ops: int, latest_minted_at: int | None = None
) -> tuple[list[IncomingOp], bool]:
    """`{"ops": [...], "atomic"?: bool}` → (ops, atomic); `latest_minted_at` as `parse_ops`."""
    if not isinstance(body, dict):
        raise Problem(400, "malformed_json", 'body must be an object {"ops": [...]}')
    # One vocabulary on every route (docs/problems.md): a body that is not JSON, or not an
    # object, is `malformed_json`; a member that is unknown or of the wrong type is
    # `invalid_field` (tests/server/http/test_inputs.py).
    unknown = set(body) - {"ops", "atomic"}
    if unknown:
        raise Problem(422, "invalid_field", f"unknown members: {sorted(unknown)}")
    atomic = body.get("atomic", False)
    if not isinstance(atomic, bool):
        raise Problem(422, "invalid_field", '"atomic" must be a boolean')
    return parse_ops(body.get("ops"), max_ops, latest_minted_at), atomic
