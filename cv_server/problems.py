"""Errors as `application/problem+json` with a stable `code` (DESIGN §5, §11).

Handlers raise `Problem`; the middleware in `app.py` turns it (and anything unexpected) into a
response, so no error can take the server down or leak a stack trace.
"""

from __future__ import annotations

import json
from typing import Any, Final

from aiohttp import web

__all__ = ["PROBLEM_BASE", "Problem", "problem_response"]

PROBLEM_BASE: Final = "https://cv-workspace.dev/problems/"

_TITLES: Final = {
    "bad_request": "The request is not one this route accepts",
    "malformed_json": "The body is not valid JSON of the expected shape",
    "body_too_large": "The body is larger than the server accepts",
    "too_many_ops": "Too many ops in one request",
    "unknown_op_type": "Unknown op type",
    "invalid_id": "An identifier breaks its pattern",
    "invalid_field": "A field has the wrong type or is not allowed",
    "unauthorized": "Missing or invalid bearer token",
    "forbidden_workspace": "The token does not grant this workspace",
    "not_found": "Not found",
    "method_not_allowed": "Method not allowed",
    "rate_limited": "Too many requests",
    "internal": "Internal server error",
    "unavailable": "The server is not ready or is shutting down",
}


class Problem(Exception):
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

    def to_json(self) -> dict[str, Any]:
        return {
            "type": PROBLEM_BASE + self.code,
            "title": _TITLES.get(self.code, self.code),
            "status": self.status,
            "detail": self.detail,
            "code": self.code,
            **self.extra,
        }


def problem_response(problem: Problem) -> web.Response:
    return web.Response(
        status=problem.status,
        text=json.dumps(problem.to_json()),
        content_type="application/problem+json",
        headers=problem.headers,
    )
