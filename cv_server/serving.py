"""`ServerRunner`: how `cv-server serve` runs the app, so that even the requests aiohttp's HTTP
parser refuses are answered as problem+json with a code.

A request the parser cannot read (a header field or request line past its 8,190 bytes, a bad
method, a malformed header) never reaches the app or its middleware: aiohttp answers it from its
connection handler (`RequestHandler.handle_error`) with a bare text/plain 400, and offers no hook
for it (aio-libs/aiohttp#3287). The runner's connection handler overrides that one method; the
logging, and the refusal to write a second response once one has started, stay aiohttp's.
Pinned by tests/server/test_serving.py.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from cv_server.http.problems import PROBLEM_BASE, Problem, problem_response
from cv_server.keys import CONFIG

__all__ = ["ServerRunner", "parser_problem"]


def parser_problem(status: int, exc: BaseException | None) -> Problem:
    """The problem for what aiohttp's connection handler answers by itself: a parser refusal
    (`status` 400) or a failure outside the app (500, or 504 for a timeout). The detail never
    quotes the request: it may carry a bearer token."""
    if isinstance(exc, LineTooLong):
        return Problem(
            400, "line_too_long", "the request line or a header field is longer than 8190 bytes"
        )
    if isinstance(exc, HttpProcessingError) or 400 <= status < 500:
        return Problem(400, "malformed_request", f"the request is not well-formed HTTP ({status})")
    return Problem(500, "internal", "unexpected server error")


class _ProblemRequestHandler(RequestHandler):
    __slots__ = ()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # aiohttp's: logs the error, and raises if a response was already started.
        super().handle_error(request, status, exc, message)
        type_base = getattr(self._manager, "problem_type_base", PROBLEM_BASE)
        response = problem_response(parser_problem(status, exc), type_base)
        response.force_close()
        return response


class _ProblemServer(web.Server):
    """aiohttp's low-level server, with `_ProblemRequestHandler` as the connection protocol."""

    def __init__(self, server: web.Server, kwargs: dict[str, Any], problem_type_base: str) -> None:
        self.problem_type_base = problem_type_base  # the app's, for the answers made here
        super().__init__(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            **kwargs,
        )
        self._handler_kwargs = kwargs

    def __call__(self) -> RequestHandler:
        return _ProblemRequestHandler(self, **self._handler_kwargs)


class ServerRunner(web.AppRunner):
    """`web.AppRunner` whose connections answer parser refusals as problem+json."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # The same arguments aiohttp gave its own server (the app's `handler_args` included).
        kwargs: dict[str, Any] = dict(server._kwargs)
        kwargs["loop"] = server._loop
        return _ProblemServer(server, kwargs, self.app[CONFIG].problem_type_base)
