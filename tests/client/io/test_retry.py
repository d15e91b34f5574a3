"""Which answers are retried, how long the client waits, and what it raises: against a scripted
stand-in for the server that answers with the problems the real one sends under load (429 with
Retry-After, 5xx, 413), which the real server cannot be made to produce on demand."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from cv_mutations import NodeIncrement, NodeInsert
from cv_workspace_client import (
    InvalidRequestError,
    NotFoundError,
    ProtocolError,
    ServerError,
    StillPendingError,
    WorkspaceClient,
)

from ..helpers import WS, RecordingSleep, fast_config

ServerFactory = Callable[..., Awaitable[TestServer]]


def problem(status: int, code: str, **extra: Any) -> web.Response:
    body = {"type": f"docs/problems.md#{code}", "title": code, "status": status}
    body.update({"detail": code, "code": code, **extra})
    headers = {"Retry-After": str(extra.pop("retry_after"))} if "retry_after" in extra else {}
    return web.Response(
        status=status,
        text=json.dumps(body),
        content_type="application/problem+json",
        headers=headers,
    )


class ScriptedServer:
    """Answers each request with the next scripted problem, then commits like the real server
    (clock + 1 per op). Records the op_ids of every request it received."""

    def __init__(self) -> None:
        self.script: deque[web.Response | Callable[[list[dict[str, Any]]], web.Response]] = deque()
        self.requests: list[list[str]] = []
        self.clock = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/workspaces/{ws}/docs/{sub_doc}/ops", self.post_ops)
        app.router.add_get("/v1/workspaces/{ws}/docs/{sub_doc}", self.get_doc)
        app.router.add_get("/v1/workspaces/{ws}/socket", self.no_socket)
        return app

    async def post_ops(self, request: web.Request) -> web.Response:
        ops = (await request.json())["ops"]
        self.requests.append([op["op_id"] for op in ops])
        if self.script:
            answer = self.script.popleft()
            return answer(ops) if callable(answer) else answer
        results = []
        for op in ops:
            self.clock += 1
            results.append({"op_id": op["op_id"], "clock": self.clock, "duplicate": False})
        return web.json_response({"results": results})

    async def get_doc(self, request: web.Request) -> web.Response:
        self.requests.append([])
        if self.script:
            answer = self.script.popleft()
            assert isinstance(answer, web.Response)
            return answer
        state: dict[str, Any] = {"nodes": {"root": {"parent": None, "children": [], "fields": {}}}}
        return web.json_response({"clock": self.clock, "state": state})

    async def no_socket(self, request: web.Request) -> web.Response:
        return problem(404, "not_found")


@pytest.fixture
async def scripted(aiohttp_server: ServerFactory) -> tuple[ScriptedServer, str]:
    fake = ScriptedServer()
    server = await aiohttp_server(fake.app())
    return fake, str(server.make_url("")).rstrip("/")


def client_for(url: str, sleep: RecordingSleep, **config: Any) -> WorkspaceClient:
    """The default retry policy (base 1 s, cap 300 s, 5 attempts) with a recording sleep."""
    options: dict[str, Any] = {"retry_base_seconds": 1.0, "retry_cap_seconds": 300.0}
    options.update(config)
    return WorkspaceClient(
        url, token="t", config=fast_config(ops_over_websocket=False, sleep=sleep, **options)
    )


async def test_a_429_waits_the_retry_after_the_server_asked_for(
    scripted: tuple[ScriptedServer, str],
) -> None:
    fake, url = scripted
    fake.script.append(problem(429, "rate_limited", retry_after=2))
    sleep = RecordingSleep()
    async with client_for(url, sleep) as client:
        commit = await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
    assert sleep.delays == [2.0]
    assert fake.requests == [[commit.op_id], [commit.op_id]]  # the same op_id, twice


async def test_a_503_with_retry_after_waits_what_the_server_or_proxy_asked_for(
    scripted: tuple[ScriptedServer, str],
) -> None:
    # A server or a proxy in maintenance answers 503 with Retry-After (RFC 9110 §10.2.3): the
    # client waits that long (not a random jitter) and resends under the same op_id.
    fake, url = scripted
    fake.script.append(problem(503, "unavailable", retry_after=120))
    sleep = RecordingSleep()
    async with client_for(url, sleep) as client:
        commit = await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
    assert sleep.delays == [120.0]
    assert fake.requests == [[commit.op_id], [commit.op_id]]


async def test_reads_honour_a_503s_retry_after(scripted: tuple[ScriptedServer, str]) -> None:
    fake, url = scripted
    fake.script.append(problem(503, "unavailable", retry_after=45))
    sleep = RecordingSleep()
    async with client_for(url, sleep) as client:
        clock, _ = await client.get_state(WS, "tree")
    assert clock == 0
    assert sleep.delays == [45.0]


async def test_5xx_answers_are_retried_with_full_jitter_under_the_same_op_id(
    scripted: tuple[ScriptedServer, str],
) -> None:
    fake, url = scripted
    fake.script.extend([problem(503, "unavailable"), problem(500, "internal")])
    sleep = RecordingSleep()
    async with client_for(url, sleep) as client:
        commit = await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
    assert len(sleep.delays) == 2
    assert 0 <= sleep.delays[0] <= 1.0
    assert 0 <= sleep.delays[1] <= 2.0
    assert fake.requests == [[commit.op_id]] * 3


async def test_five_failed_attempts_leave_the_op_pending_with_its_op_id(
    scripted: tuple[ScriptedServer, str],
) -> None:
    fake, url = scripted
    fake.script.extend(problem(500, "internal") for _ in range(5))
    sleep = RecordingSleep()
    async with client_for(url, sleep) as client:
        with pytest.raises(StillPendingError) as caught:
            await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        assert isinstance(caught.value.last_error, ServerError)
        assert client.pending_count() == 1
        assert len(fake.requests) == 5
        assert len(sleep.delays) == 4
        # The next submit starts a new attempt cycle: the pending op goes first, same op_id.
        await client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
        assert client.pending_count() == 0
    assert fake.requests[5][0] == caught.value.op_id


async def test_a_4xx_problem_is_final_and_raised_typed(
    scripted: tuple[ScriptedServer, str],
) -> None:
    fake, url = scripted
    fake.script.append(problem(404, "not_found"))
    sleep = RecordingSleep()
    async with client_for(url, sleep) as client:
        with pytest.raises(NotFoundError):
            await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        assert client.pending_count() == 0
    assert sleep.delays == []
    assert len(fake.requests) == 1


async def test_a_problem_naming_one_op_fails_it_alone_and_the_rest_commit(
    scripted: tuple[ScriptedServer, str],
) -> None:
    fake, url = scripted
    fake.script.append(problem(422, "invalid_field", op_index=1))
    async with client_for(url, RecordingSleep()) as client:
        with pytest.raises(InvalidRequestError) as caught:
            await client.apply_ops(
                WS, "tree", [NodeInsert(node_id=f"n{i}", parent_id="root") for i in range(3)]
            )
    assert caught.value.code == "invalid_field"
    assert caught.value.op_index == 1
    first, second = fake.requests
    assert second == [first[0], first[2]]


async def test_a_batch_too_big_for_the_server_is_split_not_failed(
    scripted: tuple[ScriptedServer, str],
) -> None:
    fake, url = scripted
    fake.script.append(problem(413, "body_too_large"))
    async with client_for(url, RecordingSleep()) as client:
        outcomes = await client.apply_ops(
            WS, "tree", [NodeInsert(node_id=f"n{i}", parent_id="root") for i in range(4)]
        )
    assert [o.clock for o in outcomes] == [1, 2, 3, 4]  # type: ignore[union-attr]
    assert [len(ops) for ops in fake.requests] == [4, 2, 2]


async def test_reads_are_retried_by_tenacity_honouring_retry_after(
    scripted: tuple[ScriptedServer, str],
) -> None:
    fake, url = scripted
    fake.script.extend([problem(429, "rate_limited", retry_after=3), problem(502, "unavailable")])
    sleep = RecordingSleep()
    async with client_for(url, sleep) as client:
        clock, state = await client.get_state(WS, "tree")
    assert clock == 0
    assert list(state.nodes) == ["root"]
    assert sleep.delays[0] == 3.0
    assert len(sleep.delays) == 2


class SilentSocketServer:
    """A websocket that takes every frame and never answers an apply: the acks are lost."""

    def __init__(self) -> None:
        self.applies: list[tuple[str, list[str]]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/workspaces/{ws}/socket", self.socket)
        return app

    async def socket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for message in ws:
            body = json.loads(message.data)
            for frame in body if isinstance(body, list) else [body]:
                if frame.get("type") == "apply":
                    ops = [op["op_id"] for op in frame["ops"]]
                    self.applies.append((frame["sub_doc"], ops))
        return ws


async def test_applies_whose_acks_never_come_time_out_and_are_resent_under_their_op_ids(
    aiohttp_server: ServerFactory,
) -> None:
    fake = SilentSocketServer()
    server = await aiohttp_server(fake.app())
    config = fast_config(request_timeout_seconds=0.2, retry_attempts=3)
    async with WorkspaceClient(str(server.make_url("")), token="t", config=config) as client:
        await client.connect(WS, timeout=5)
        outcomes = await asyncio.wait_for(
            asyncio.gather(
                client.apply_op(WS, "a", NodeIncrement(node_id="n", field="c")),
                client.apply_op(WS, "b", NodeIncrement(node_id="n", field="c")),
                return_exceptions=True,
            ),
            10,
        )
        assert all(isinstance(o, StillPendingError) for o in outcomes), outcomes
        assert client.pending_count() == 2  # still in the outbox, replayed on the next connect
    op_ids = {doc: o.op_id for doc, o in zip("ab", outcomes, strict=True)}  # type: ignore[union-attr]
    for doc in "ab":  # three sends per op (retry_attempts), each after the previous timed out
        assert [ops for sub_doc, ops in fake.applies if sub_doc == doc] == [[op_ids[doc]]] * 3


def _page(status: int) -> web.Response:
    """A proxy's own page: HTML, no problem document (one Response per answer: aiohttp sends
    each once)."""
    return web.Response(status=status, text="<html>no route here</html>", content_type="text/html")


@pytest.mark.parametrize("status", [400, 404, 421])
async def test_a_bare_4xx_from_something_in_between_keeps_the_op_and_retries_it(
    scripted: tuple[ScriptedServer, str], status: int
) -> None:
    """A proxy's own page (no problem document: the server never saw the request) does not fail
    the op for good: the op stays in the outbox and is sent again."""
    fake, url = scripted
    fake.script.extend(_page(status) for _ in range(2))
    sleep = RecordingSleep()
    async with client_for(url, sleep) as client:
        commit = await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
    assert len(sleep.delays) == 2  # retried with the backoff, as a lost answer is
    assert fake.requests == [[commit.op_id]] * 3  # the same op_id each time, applied once


async def test_a_bare_4xx_to_the_last_attempt_leaves_the_op_pending_not_failed(
    scripted: tuple[ScriptedServer, str],
) -> None:
    fake, url = scripted
    fake.script.extend(_page(404) for _ in range(3))
    sleep = RecordingSleep()
    async with client_for(url, sleep, retry_attempts=3) as client:
        with pytest.raises(StillPendingError) as pending:
            await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        assert client.pending_count() == 1  # still in the outbox, to go once the route is fixed
        assert isinstance(pending.value.last_error, ProtocolError)
        await client.wait_synced(timeout=10)  # the proxy answers for the server again
    assert fake.requests[-1] == [pending.value.op_id]
    assert fake.clock == 1
