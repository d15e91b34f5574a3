"""The SDK's one exception hierarchy, and the pure mapping from the server's problem codes to it.

Every error the client raises is a `WorkspaceError` with a stable string `code` (the server's own
code when the server answered, docs/protocol.md). Whether an error is worth retrying is a property
of its class (`retryable`): only connection errors, timeouts (a 408 included), 5xx and 429 are
(docs/client.md); any other 4xx answer is final and is never retried.

Pure: no I/O, so the sans-I/O core may import it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any, ClassVar, Final

__all__ = [
    "AuthError",
    "ClientClosedError",
    "ConnectionFailedError",
    "ExpectedError",
    "ForbiddenError",
    "InvalidRequestError",
    "LeaseLostError",
    "LogCompactedError",
    "NotFoundError",
    "OpDiscardedError",
    "OpRejectedError",
    "OutboxError",
    "ProtocolError",
    "RateLimitedError",
    "RequestCancelledError",
    "ServerError",
    "StillPendingError",
    "VersionConflictError",
    "WorkspaceError",
    "error_from_problem",
]


class WorkspaceError(Exception):
    """Base of every SDK error. `code` is stable; `message` is for humans."""

    #: Seconds the server (or a proxy in front of it) asked the client to wait before trying
    #: again (`Retry-After`); only a 429 or a 5xx answer carries one.
    retry_after: float | None = None

    #: True when the same request may succeed later (the SDK retries it with backoff).
    retryable: ClassVar[bool] = False

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message


# -- retryable: the request may or may not have reached the server -------------------------------


class ConnectionFailedError(WorkspaceError):
    """The connection failed, was cut, or timed out before an answer arrived.

    The request may have been applied: that is why every op carries an op_id and is retried with
    the same one, never re-minted.
    """

    retryable = True


class ServerError(WorkspaceError):
    """A 5xx answer (`internal`, `unavailable`, ...). `retry_after` is the `Retry-After` that came
    with it (a 503 from a server or proxy in maintenance, RFC 9110 §10.2.3), if any."""

    retryable = True

    def __init__(
        self,
        code: str,
        message: str = "",
        *,
        status: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(code, message)
        self.status = status
        self.retry_after = retry_delay(retry_after)


class RateLimitedError(WorkspaceError):
    """429 `rate_limited`; `retry_after` (seconds) is the server's `Retry-After`, if it sent one."""

    retryable = True

    def __init__(self, code: str, message: str = "", *, retry_after: float | None = None) -> None:
        super().__init__(code, message)
        self.retry_after = retry_delay(retry_after)


class ProtocolError(WorkspaceError):
    """The server's answer could not be understood (wrong shape, result count mismatch).

    Retryable: the op_id makes a resend harmless, and a proxy mangling one answer should not cost
    an op.
    """

    retryable = True


# -- final: the server answered ------------------------------------------------------------------


class InvalidRequestError(WorkspaceError):
    """A 4xx problem with the request as a whole: `malformed_json`, `body_too_large`,
    `too_many_ops`, `unknown_op_type`, `invalid_id`, `invalid_field` (with `op_index`), ...

    Nothing of the request was applied. Never retried.
    """

    def __init__(
        self,
        code: str,
        message: str = "",
        *,
        status: int | None = None,
        op_index: int | None = None,
    ) -> None:
        super().__init__(code, message)
        self.status = status
        self.op_index = op_index


class LogCompactedError(InvalidRequestError):
    """410 `log_compacted`: the ops after the `since` asked for were deleted by compaction
    (docs/operating.md, "Storage over time"). `horizon` is the lowest clock still in the log,
    `clock` the head, `state_url` where the state is read. Subscriptions handle it themselves
    (they yield a `Snapshot`); a direct `read_ops` raises it. Never retried."""

    def __init__(
        self,
        message: str = "",
        *,
        horizon: int | None = None,
        clock: int | None = None,
        state_url: str | None = None,
    ) -> None:
        super().__init__("log_compacted", message, status=410)
        self.horizon = horizon
        self.clock = clock
        self.state_url = state_url


class NotFoundError(InvalidRequestError):
    """404 `not_found`."""


class AuthError(WorkspaceError):
    """401 `unauthorized` (or websocket close 4001): the token is missing, bad or expired."""


class ForbiddenError(WorkspaceError):
    """403 `forbidden_workspace` (or websocket close 4003): the token may not touch this
    workspace; `missing_scope`: it lacks the scope this needs (any one of `required_scopes`);
    `forbidden_sub_doc`: the sub-doc is outside its grant."""

    def __init__(
        self, code: str, message: str = "", *, required_scopes: tuple[str, ...] = ()
    ) -> None:
        super().__init__(code, message)
        #: The scopes that would do (any one), from a `missing_scope` refusal; else empty.
        self.required_scopes = required_scopes


class OpRejectedError(WorkspaceError):
    """The server answered this op with a rejection; it was not applied.

    `code` is a reducer code (`node_exists`, `node_not_found`, ...), `op_id_reuse` (the op_id was
    already used for a different op) or `atomic_aborted` (another op of an atomic batch failed).
    A retry of the same op gets the same rejection back.
    """

    def __init__(self, code: str, message: str = "", *, op_id: str | None = None) -> None:
        super().__init__(code, message)
        self.op_id = op_id


class VersionConflictError(OpRejectedError):
    """An apply with `if_clock` met a sub-doc at another clock: nothing of it was applied.

    `clock` is the sub-doc's clock when the batch was decided (None if the answer did not say).
    Read the sub-doc again, recompute the ops and send them with new op_ids
    (`WorkspaceClient.read_modify_write` does it, with bounded retries; docs/ops.md#conflicts).
    """

    def __init__(
        self, message: str = "", *, clock: int | None = None, op_id: str | None = None
    ) -> None:
        super().__init__("version_conflict", message, op_id=op_id)
        self.clock = clock


# -- client side ----------------------------------------------------------------------------------


class StillPendingError(WorkspaceError):
    """No answer after the last attempt (or the client closed first). The op is **not lost**.

    It stays in the outbox under the same `op_id` and is resent, in order, on the next connect
    or (a durable outbox) by the next client opened on the same outbox. An in-memory outbox
    (`outbox=None`) keeps it only while the client is open: `close()` then drops it, with a
    warning that counts what it dropped. Do not re-submit it with a new
    op_id: that is how one intent gets applied twice. `last_error` is why the last attempt failed.
    """

    def __init__(self, op_id: str, last_error: BaseException | None = None) -> None:
        reason = f" (last error: {last_error})" if last_error is not None else ""
        super().__init__(
            "still_pending",
            f"op {op_id} got no answer{reason}; it stays in the outbox and will be resent on"
            " the next connect with the same op_id - do not re-submit it under a new one (an"
            " in-memory outbox, outbox=None, loses it if the client closes first)",
        )
        self.op_id = op_id
        self.last_error = last_error


class OpDiscardedError(WorkspaceError):
    """The app gave the op up (`WorkspaceClient.discard_pending`) before the server answered it.

    It left the outbox and will never be sent again. `maybe_applied` is False when it never
    reached the server, or the server refused it unread (a refused token); True when an earlier
    send's answer was lost (a cut connection, a timeout, a 5xx) or it was restored from the
    outbox of a previous client: the server may have applied it then, once.
    """

    def __init__(self, op_id: str, *, maybe_applied: bool) -> None:
        fate = (
            "an earlier send may have applied it (its answer was lost)"
            if maybe_applied
            else "it was never applied"
        )
        super().__init__("op_discarded", f"op {op_id} was discarded by the app: {fate}")
        self.op_id = op_id
        self.maybe_applied = maybe_applied


class ClientClosedError(WorkspaceError):
    """The client was closed before the server answered, and its outbox is in memory.

    The op may or may not have been applied and will not be resent. Use a file outbox when that
    matters.
    """

    def __init__(self, op_id: str) -> None:
        super().__init__(
            "client_closed",
            f"op {op_id} got no answer before the client closed; the outbox is in memory, so it "
            "will not be resent (it may or may not have been applied)",
        )
        self.op_id = op_id


class OutboxError(WorkspaceError):
    """The outbox could not be opened or written: `outbox_locked` (another client has it open),
    `outbox_foreign` (the file is another application's database: left untouched),
    `outbox_version` (written by a newer SDK), `outbox_open_failed` (unreadable or damaged: left
    as it was), `outbox_write_failed`, `outbox_sync_failed` (the fsync failed, or the file was
    removed or replaced while open), `outbox_read_failed` (a page of a large backlog could not be
    read: the `last_error` of the `StillPendingError` its sub-doc's new ops get).

    An op whose outbox write failed was never sent.
    """


# -- mapping ---------------------------------------------------------------------------------------


class ExpectedError(WorkspaceError):
    """Raise in a handler for an answer that is an error (bad input, forbidden, not found).

    The request completes with the payload `{"code", "message", "details"}` and is never retried
    (an expected error is an answer, not a failure, and never a path to poison).
    """

    def __init__(self, code: str, message: str = "", details: Any = None) -> None:
        super().__init__(code, message)
        self.details = details

    def payload(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}


class LeaseLostError(WorkspaceError):
    """The worker no longer holds the request (code `lease_lost`): another worker re-drove it.

    Raised by `StageContext.ensure_lease` / `apply_op` once a heartbeat found the claim token gone,
    and by the queue routes when a fenced call (heartbeat, complete, fail) is refused. The stage
    must stop writing; the worker completes nothing (River #1302: a rescuer overwrote a job that
    had just completed).
    """

    def __init__(self, message: str = "the claim token no longer holds the request") -> None:
        super().__init__("lease_lost", message)


class RequestCancelledError(WorkspaceError):
    """Someone cancelled the request this worker runs (code `cancelled`; see docs/queue.md).

    The server refuses the holder's heartbeat with it; from then on `StageContext.ensure_lease` /
    `apply_op` raise it, the worker cancels the handler and reports back, and the request ends
    `cancelled`. Writes the stage committed before stay committed.
    """

    def __init__(self, message: str = "the request was cancelled") -> None:
        super().__init__("cancelled", message)


def retry_delay(value: object) -> float | None:
    """A server's Retry-After as a delay the client can wait: a number of seconds >= 0, or None
    (no usable value: the caller falls back on its jitter).

    NaN (which Python's JSON reader takes) made the client `asyncio.sleep(nan)`, which never
    returns: the op, every later op of its sub-doc, or the read hung for good. A negative value
    meant "at once", hammering a server that asked for a pause, and an integer past a float's
    range raised `OverflowError` to the app. A huge value is kept (as the largest float): the
    retry policy's cap (docs/configuration.md, 300 s) bounds the wait where it is used.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        seconds = float(value)
    except OverflowError:
        return sys.float_info.max if value > 0 else None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


#: Codes of a server that could not do it now (an `error` frame has no status to tell): retried
#: as a 503 is. `storage_unavailable`: the storage refused the write whole (docs/problems.md).
_RETRYABLE_SERVER_CODES: Final = frozenset({"internal", "unavailable", "storage_unavailable"})

_FINAL_BY_CODE: dict[str, type[WorkspaceError]] = {
    "unauthorized": AuthError,
    "forbidden_workspace": ForbiddenError,
    # Scopes and sub-doc grants (docs/operating.md, "Tokens and scopes"): the token may not.
    "missing_scope": ForbiddenError,
    "forbidden_sub_doc": ForbiddenError,
    "token_revoked": AuthError,
    "not_found": NotFoundError,
    "schedule_not_found": NotFoundError,
    # A schedule added under a wider grant (docs/queue.md, "Schedules").
    "grant_exceeded": ForbiddenError,
}


def error_from_problem(
    status: int | None,
    problem: Mapping[str, Any] | None,
    *,
    retry_after: float | None = None,
) -> WorkspaceError:
    """Turn a server problem (HTTP problem+json body, or a websocket `error` frame) into the typed
    exception for it.

    `status` is the HTTP status (None for a websocket frame, where the code alone decides).
    Unknown codes fall back on the status class: 5xx → `ServerError`, 429 → `RateLimitedError`,
    other 4xx → `InvalidRequestError`.
    """
    body: Mapping[str, Any] = problem or {}
    raw_code = body.get("code")
    code = raw_code if isinstance(raw_code, str) and raw_code else _code_for_status(status)
    message = str(body.get("detail") or body.get("message") or body.get("title") or "")
    if retry_after is None:
        retry_after = retry_delay(body.get("retry_after"))
    if code == "rate_limited" or status == 429:
        return RateLimitedError(code, message, retry_after=retry_after)
    if status == 408:
        # The server (or a proxy) gave up waiting for the request before reading it: nothing
        # was processed, like a timeout on the way (timeouts are retried).
        return ConnectionFailedError(code, message)
    if code in _RETRYABLE_SERVER_CODES or (status is not None and status >= 500):
        return ServerError(code, message, status=status, retry_after=retry_after)
    if code == "lease_lost":
        return LeaseLostError(message) if message else LeaseLostError()
    if code == "cancelled":
        return RequestCancelledError(message) if message else RequestCancelledError()
    if code == "version_conflict":
        return VersionConflictError(message, clock=_int_or_none(body.get("clock")))
    if code == "log_compacted":
        return LogCompactedError(
            message,
            horizon=_int_or_none(body.get("horizon")),
            clock=_int_or_none(body.get("clock")),
            state_url=body.get("state_url") if isinstance(body.get("state_url"), str) else None,
        )
    final = _FINAL_BY_CODE.get(code)
    if final is ForbiddenError:
        scopes = body.get("required_scopes")
        named = tuple(str(s) for s in scopes) if isinstance(scopes, list) else ()
        return ForbiddenError(code, message, required_scopes=named)
    if final is NotFoundError:
        return NotFoundError(code, message, status=status)
    if final is not None:
        return final(code, message)
    if status == 401:
        return AuthError(code, message)
    if status == 403:
        return ForbiddenError(code, message)
    op_index = body.get("op_index")
    return InvalidRequestError(
        code,
        message,
        status=status,
        op_index=op_index if isinstance(op_index, int) and not isinstance(op_index, bool) else None,
    )


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _code_for_status(status: int | None) -> str:
    if status is None:
        return "unknown_error"
    if status == 429:
        return "rate_limited"
    if status >= 500:
        return "internal" if status == 500 else "unavailable"
    return {401: "unauthorized", 403: "forbidden_workspace", 404: "not_found"}.get(
        status, f"http_{status}"
    )
