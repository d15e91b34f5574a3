"""Errors as `application/problem+json` with a stable `code` (docs/protocol.md, docs/problems.md).

Handlers raise `Problem`; the middleware in `app.py` turns it (and anything unexpected) into a
response, so no error can take the server down or leak a stack trace.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from aiohttp import web

from cv_server.errors import CvServerError

__all__ = ["CODES", "PROBLEM_BASE", "Problem", "problem_response"]

#: The default `ServerConfig.problem_type_base`, and the `type` of every problem while it is
#: the base: RFC 9457's problem with no page of its own, the code in `code`. A relative `type`
#: resolves against the request's URL, into a page that does not exist. Any other base is a
#: prefix the code is appended to, docs/problems.md having an anchor per code
#: (tests/server/http/test_problems.py, tests/test_docs.py).
PROBLEM_BASE: Final = "about:blank"

#: Every code the server answers with (problem+json bodies, websocket `error` frames), and its
#: title. The SDK maps each to a typed exception; tests/client/io/test_http.py holds the
#: two together, so a code the server starts sending fails there until it is listed here and
#: given its SDK type.
CODES: Final[Mapping[str, str]] = {
    "bad_request": "The request is not one this route accepts",
    "malformed_json": "The body is not valid JSON of the expected shape",
    "body_too_large": "The body is larger than the server accepts",
    "malformed_body": "The body does not decode as its Content-Encoding says",
    "unsupported_content_encoding": "The body's Content-Encoding is not one the server decodes",
    "unsupported_media_type": "The body's Content-Type is not JSON",
    "line_too_long": "The request line or a header field is longer than the server reads",
    "malformed_request": "The request is not well-formed HTTP",
    "too_many_subscriptions": "The socket already has as many subscriptions as the server allows",
    "too_many_ops": "Too many ops in one request",
    "unknown_op_type": "Unknown op type",
    "invalid_id": "An identifier breaks its pattern",
    "invalid_field": "A field has the wrong type or is not allowed",
    "unauthorized": "Missing or invalid bearer token",
    "forbidden_workspace": "The token does not grant this workspace",
    "missing_scope": "The token lacks the scope this route or frame needs",
    "forbidden_sub_doc": "The token does not grant this sub-doc",
    "token_revoked": "The token was revoked",
    "not_found": "Not found",
    "method_not_allowed": "Method not allowed",
    "unknown_message_type": "Unknown websocket message type",
    "rate_limited": "Too many requests",
    "idempotency_key_reuse": "The Idempotency-Key was used for a different request",
    "idempotency_key_in_progress": "The first request with this Idempotency-Key is still running",
    "idempotency_key_lost": "The Idempotency-Key lapsed before its request finished",
    "lease_lost": "The claim token no longer holds the request",
    "invalid_transition": "The request is not in a state that allows this",
    "request_id_conflict": "The request id is taken by a different request",
    "cancelled": "The request was cancelled: stop working on it",
    "not_cancellable": "The request already finished: there is nothing to cancel",
    "not_discardable": "Only a poison request may be discarded",
    "result_too_large": "The result is larger than the server's max_result_bytes",
    "version_conflict": "The sub-doc moved past the clock the write was based on: read and retry",
    "log_compacted": "The ops asked for were compacted: read the state, then the ops after it",
    "schedule_exists": "The workspace already has a schedule of that name",
    "schedule_not_found": "No schedule of that name",
    "grant_exceeded": "The schedule's grant is wider than the token's",
    "internal": "Internal server error",
    "unavailable": "The server is not ready or is shutting down",
    "storage_unavailable": "The storage refuses writes (disk full or read-only): retry later",
}


class Problem(CvServerError):
    """An HTTP error answer. `extra` members are added to the problem document."""

    def __init__(
        self,
        status: int,
        code: str,
        detail: str = "",
        *,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(f"{code}: {detail}")
        self.headers = headers
        self.status = status
        self.code = code
        self.detail = detail
        self.extra = extra

    def to_json(self, type_base: str = PROBLEM_BASE) -> dict[str, Any]:
        return {
            "type": PROBLEM_BASE if type_base == PROBLEM_BASE else type_base + self.code,
            "title": CODES.get(self.code, self.code),
            "status": self.status,
            "detail": self.detail,
            "code": self.code,
            **self.extra,
        }


def problem_response(problem: Problem, type_base: str = PROBLEM_BASE) -> web.Response:
    """The problem as an HTTP answer; `type_base` is the server's `problem_type_base`."""
    return web.Response(
        status=problem.status,
        text=json.dumps(problem.to_json(type_base)),
        content_type="application/problem+json",
        headers=problem.headers,
    )
