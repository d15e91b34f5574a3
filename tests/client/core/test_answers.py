"""The SDK's one reading of an HTTP answer (`cv_workspace_client._core.answers`), as pure rules, and
the same reading on the op-log path and the queue path through real HTTP on loopback."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from cv_workspace_client import (
    ClientConfig,
    ConnectionFailedError,
    InvalidRequestError,
    LeaseLostError,
    NotFoundError,
    ProtocolError,
    QueueClient,
    RateLimitedError,
    ServerError,
    WorkspaceClient,
)
from cv_workspace_client._core.answers import ANY_SUCCESS, answer_error, read_answer

from ..helpers import RecordingSleep

PROBLEM = {"Content-Type": "application/problem+json"}


def problem(code: str, **extra: Any) -> bytes:
    return json.dumps({"type": f"about:{code}", "code": code, "detail": "why", **extra}).encode()


def test_an_accepted_status_is_its_json() -> None:
    assert read_answer(200, b'{"a": 1}', {}) == {"a": 1}
    assert read_answer(202, b'{"a": 1}', {}, accept=ANY_SUCCESS) == {"a": 1}
    assert read_answer(204, b"", {}, accept=ANY_SUCCESS) is None


@pytest.mark.parametrize("raw", [b"", b"{", b"[" * 100_000], ids=["empty", "cut", "too_deep"])
def test_an_accepted_status_with_a_body_that_is_not_json_is_a_bad_answer(raw: bytes) -> None:
    with pytest.raises(ProtocolError) as caught:
        read_answer(200, raw, {})
    assert caught.value.code == "bad_answer"
    assert caught.value.retryable


@pytest.mark.parametrize("status", [201, 204, 301, 302, 307])
def test_a_status_the_op_log_routes_never_send_is_not_an_answer(status: int) -> None:
    with pytest.raises(ProtocolError) as caught:
        read_answer(status, b"", {"Location": "http://elsewhere/"})
    assert caught.value.code == "bad_answer"
    assert caught.value.retryable


def test_a_problem_document_is_its_typed_error_with_its_retry_after() -> None:
    assert isinstance(answer_error(404, problem("not_found"), PROBLEM), NotFoundError)
    lease = answer_error(409, problem("lease_lost"), PROBLEM)
    assert isinstance(lease, LeaseLostError)
    assert lease.message == "why"
    limited = answer_error(429, problem("rate_limited"), {**PROBLEM, "Retry-After": "3"})
    assert isinstance(limited, RateLimitedError)
    assert limited.retry_after == 3.0
    rejected = answer_error(422, problem("invalid_field", op_index=2), PROBLEM)
    assert isinstance(rejected, InvalidRequestError)
    assert rejected.op_index == 2


@pytest.mark.parametrize(
    ("status", "kind", "code"),
    [
        (408, ConnectionFailedError, "timeout"),
        (401, Exception, "unauthorized"),
        (413, InvalidRequestError, "body_too_large"),
        (429, RateLimitedError, "rate_limited"),
        (502, ServerError, "unavailable"),
        (404, ProtocolError, "bad_answer"),
        (400, ProtocolError, "bad_answer"),
        (421, ProtocolError, "bad_answer"),
    ],
)
def test_a_bare_status_from_something_in_between_is_read_by_its_status(
    status: int, kind: type[Exception], code: str
) -> None:
    error = answer_error(status, b"<html>proxy page</html>", {"Content-Type": "text/html"})
    assert isinstance(error, kind)
    assert error.code == code


class Flaky:
    """Answers its first request on each route with a proxy's bare `text/html` 404 (the server
    behind never saw it), then as the server would."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def _first(self, request: web.Request) -> bool:
        count = self.seen[request.path] = self.seen.get(request.path, 0) + 1
        return count == 1

    async def request_row(self, request: web.Request) -> web.Response:
        if self._first(request):
            return web.Response(status=404, text="<html>no route</html>", content_type="text/html")
        return web.json_response(
            {
                "request_id": request.match_info["id"],
                "workspace_id": request.match_info["ws"],
                "stage": "s",
                "status": "pending",
            }
        )

    async def state(self, request: web.Request) -> web.Response:
        if self._first(request):
            return web.Response(status=404, text="<html>no route</html>", content_type="text/html")
        root: dict[str, Any] = {"parent": None, "children": [], "fields": {}}
        return web.json_response({"clock": 0, "state": {"nodes": {"root": root}}})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/workspaces/{ws}/requests/{id}", self.request_row)
        app.router.add_get("/v1/workspaces/{ws}/docs/{doc}", self.state)
        return app


@pytest.fixture
async def flaky(aiohttp_server: Any) -> tuple[Flaky, str]:
    fake = Flaky()
    server: TestServer = await aiohttp_server(fake.app())
    return fake, str(server.make_url("")).rstrip("/")


async def test_a_queue_read_answered_by_a_proxy_s_bare_404_is_retried_like_an_op_log_read(
    flaky: tuple[Flaky, str],
) -> None:
    # The queue's calls read answers as the op-log's do: a bare 404 never reached the server,
    # so it is retried, not taken for the server's `not_found` (a request that does not exist).
    fake, url = flaky
    config = ClientConfig(sleep=RecordingSleep())
    async with aiohttp.ClientSession() as session:
        queue = QueueClient(url, "t", config=config, session=session)
        row = await queue.get_request("ws1", "r1")
    assert row.request_id == "r1"
    async with WorkspaceClient(url, token="t", config=config) as client:
        clock, _ = await client.get_state("ws1", "tree")
    assert clock == 0
    assert fake.seen == {"/v1/workspaces/ws1/requests/r1": 2, "/v1/workspaces/ws1/docs/tree": 2}
