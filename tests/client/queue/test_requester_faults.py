"""The SDK's queue API through a `FaultProxy`: an enqueue whose answer is lost is enqueued once
whatever the retries, and `wait_request` reports the final outcome exactly, survives a cut stream,
honours its own deadline on a stalled network and holds no connection once it returned."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from cv_server.keys import WAITERS
from cv_workspace_client import WorkspaceClient
from cv_workspace_client._queue import holder as holder
from cv_workspace_client._queue import requester as api
from cv_workspace_client.config import ClientConfig
from cv_workspace_client.errors import WorkspaceError
from cv_workspace_client.testing import FaultProxy
from tests.worker.conftest import WS, MakeServer, fast_client_config, token_for, url_of

BOUND = 10.0  # no test here may hang: every wait on a state is bounded by this


@asynccontextmanager
async def direct(server: TestServer) -> AsyncIterator[api.QueueClient]:
    """A queue client straight to the server (no proxy): the worker's and the inspector's side."""
    async with api.QueueClient(url_of(server), token_for(WS), config=fast_client_config()) as qc:
        yield qc


@asynccontextmanager
async def through(
    proxy: FaultProxy, config: ClientConfig | None = None
) -> AsyncIterator[WorkspaceClient]:
    """The app's `WorkspaceClient`, talking to the server through `proxy`."""
    async with WorkspaceClient(
        proxy.url, token=token_for(WS), config=config or fast_client_config()
    ) as client:
        yield client


async def _finish(qc: api.QueueClient, request_id: str, result: object) -> None:
    (claimed,) = await holder.claim(qc, ["s"], "second-holder")
    assert claimed.request.request_id == request_id
    await holder.complete(qc, WS, request_id, claimed.claim_token, result=result)


async def _until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(BOUND):
        while not condition():  # noqa: ASYNC110  (a state, not a duration)
            await asyncio.sleep(0.005)


# -- enqueue: once, whatever the retries -----------------------------------------------------------


async def test_an_enqueue_with_a_job_id_whose_answer_is_cut_is_retried_into_the_same_request(
    server: TestServer,
) -> None:
    async with FaultProxy(url_of(server)) as proxy, direct(server) as qc:
        proxy.cut_next(1)  # the server commits the row, the answer never arrives
        async with through(proxy) as client:
            answer = await client.enqueue(WS, stage="s", job_id="J1", input={"a": 1})
        rows = await qc.list_requests(workspace_id=WS)
        assert proxy.stats.cuts == 1
    # The retry is answered from the call's Idempotency-Key: the request its own lost attempt
    # made, not one "coalesced" from another enqueue (it was reported coalesced before).
    assert answer.replayed
    assert not answer.coalesced
    assert [row.request_id for row in rows] == [answer.request_id]
    assert rows[0].input == {"a": 1}


async def test_an_enqueue_without_job_id_whose_answer_is_cut_is_replayed_not_forked(
    server: TestServer,
) -> None:
    async with FaultProxy(url_of(server)) as proxy, direct(server) as qc:
        proxy.cut_next(1)
        async with through(proxy) as client:
            answer = await client.enqueue(WS, stage="s", input={"a": 1})
        rows = await qc.list_requests(workspace_id=WS)
        assert proxy.stats.cuts == 1
    # The SDK minted one Idempotency-Key and sent it again: the server answered from the key.
    assert answer.replayed
    assert not answer.coalesced
    assert [row.request_id for row in rows] == [answer.request_id]


async def test_an_enqueue_whose_every_answer_is_cut_fails_yet_leaves_exactly_one_request(
    server: TestServer,
) -> None:
    config = ClientConfig(retry_base_seconds=0.001, retry_cap_seconds=0.005, retry_attempts=3)
    async with FaultProxy(url_of(server)) as proxy, direct(server) as qc:
        proxy.cut_next(3)  # every attempt is cut: the caller sees the error ...
        async with through(proxy, config) as client:
            with pytest.raises(WorkspaceError) as raised:
                await client.enqueue(WS, stage="s", input={"a": 1})
        rows = await qc.list_requests(workspace_id=WS)
        assert proxy.stats.cuts == 3
    assert raised.value.retryable
    assert len(rows) == 1  # ... but three attempts under one key committed one request


async def test_a_rerun_whose_answer_is_cut_runs_once_even_if_it_finished_before_the_retry(
    server: TestServer,
) -> None:
    """`rerun=True` re-opens a finished deterministic request: a repeat of it is not harmless.
    If the re-opened run finishes between the lost answer and the retry, a retry without an
    Idempotency-Key re-opens it a second time — the stage the app meant once runs twice."""
    async with FaultProxy(url_of(server)) as proxy, direct(server) as qc:
        first = await qc.enqueue(WS, stage="s", job_id="J1")
        await _finish(qc, first.request_id, "run 1")
        slept = 0

        async def a_fast_worker_finishes_the_rerun_meanwhile(delay: float) -> None:
            nonlocal slept
            slept += 1
            if slept == 1:  # between the cut answer and the SDK's retry
                await _finish(qc, first.request_id, "run 2")

        config = ClientConfig(
            retry_base_seconds=0.001,
            retry_cap_seconds=0.005,
            sleep=a_fast_worker_finishes_the_rerun_meanwhile,
        )
        proxy.cut_next(1)
        async with through(proxy, config) as client:
            again = await client.enqueue(WS, stage="s", job_id="J1", rerun=True)
        row = await qc.get_request(WS, first.request_id)
        assert proxy.stats.cuts == 1
        assert slept >= 1
    assert again.request_id == first.request_id
    assert row.run == 2, f"the rerun ran {row.run - 1} times"
    assert row.status == "done"
    assert row.result == "run 2"


# -- wait_request: the exact outcome, through cuts and stalls --------------------------------------


async def test_a_wait_whose_stream_is_cut_mid_way_reports_the_poison_and_its_error(
    make_server: MakeServer,
) -> None:
    server = await make_server(failure_backoff_seconds=0.0)
    assert server.app is not None
    waiters = server.app[WAITERS]
    async with FaultProxy(url_of(server)) as proxy, direct(server) as qc:
        answer = await qc.enqueue(WS, stage="s", job_id="J1", max_dequeues=1)
        async with through(proxy) as client:
            waiting = asyncio.create_task(client.wait_request(WS, answer.request_id, timeout=30))
            await _until(lambda: waiters.count == 1)  # the stream is open and parked
            assert proxy.drop_all() == 1  # both sides see a reset mid-stream
            (claimed,) = await holder.claim(qc, ["s"], "second-holder")
            status, _ = await holder.fail(
                qc, WS, answer.request_id, claimed.claim_token, {"code": "boom"}
            )
            assert status == "poison"
            outcome = await asyncio.wait_for(waiting, BOUND)
        assert proxy.stats.accepted >= 2  # it came back after the cut
    assert outcome.status == "poison"
    assert not outcome.ok
    assert outcome.error == {"code": "boom"}
    assert outcome.request is not None
    assert outcome.request.status == "poison"


async def test_a_wait_whose_stream_is_cut_as_it_carries_the_answer_still_gets_the_result(
    server: TestServer,
) -> None:
    assert server.app is not None
    waiters = server.app[WAITERS]
    async with FaultProxy(url_of(server)) as proxy, direct(server) as qc:
        answer = await qc.enqueue(WS, stage="s", job_id="J1")
        async with through(proxy) as client:
            waiting = asyncio.create_task(client.wait_request(WS, answer.request_id, timeout=30))
            await _until(lambda: waiters.count == 1)
            assert proxy.cut_open() == 1  # the next chunk on the stream, `done`, is dropped
            await _finish(qc, answer.request_id, {"rows": [1, 2, 3]})
            outcome = await asyncio.wait_for(waiting, BOUND)
        assert proxy.stats.cuts == 1
        assert proxy.stats.accepted == 2  # one reconnect, answered from the row
    assert outcome.status == "done"
    assert outcome.ok
    assert outcome.result == {"rows": [1, 2, 3]}


async def test_a_wait_on_a_stalled_network_ends_at_its_own_timeout(server: TestServer) -> None:
    """The server never gets a word through (a stalled link, not a reset): the wait must still
    end at `timeout` with status `timeout`, not at the HTTP layer's much later deadline."""
    async with FaultProxy(url_of(server)) as proxy, direct(server) as qc:
        answer = await qc.enqueue(WS, stage="s", job_id="J1")
        proxy.delay = 60.0  # every server chunk is held a minute
        async with through(proxy) as client:
            # Its own 0.5 s, not the HTTP layer's 300 s (the request timeout): the bound only
            # tells the two apart.
            async with asyncio.timeout(BOUND):
                outcome = await client.wait_request(WS, answer.request_id, timeout=0.5)
    assert outcome.status == "timeout"
    assert outcome.request_id == answer.request_id


async def test_a_zero_timeout_wait_still_reports_an_outcome_already_on_the_row(
    server: TestServer,
) -> None:
    """`timeout=0` is a look, not a blindfold: a finished request is reported as finished, and a
    live one as a timeout that carries the row as it stands."""
    async with direct(server) as qc:
        done = await qc.enqueue(WS, stage="s", job_id="J1")
        await _finish(qc, done.request_id, "ready")
        live = await qc.enqueue(WS, stage="s", job_id="J2")
        finished = await qc.wait_request(WS, done.request_id, timeout=0)
        pending = await qc.wait_request(WS, live.request_id, timeout=0)
    assert finished.status == "done"
    assert finished.result == "ready"
    assert pending.status == "timeout"
    assert pending.request is not None
    assert pending.request.status == "pending"


def _in_use(client: WorkspaceClient) -> int:
    connector = client.session.connector
    assert isinstance(connector, aiohttp.TCPConnector)
    return len(connector._acquired)  # what the pool has lent out right now


async def test_a_finished_wait_holds_no_connection_when_it_returns(server: TestServer) -> None:
    async with direct(server) as qc:
        answer = await qc.enqueue(WS, stage="s", job_id="J1")
        await _finish(qc, answer.request_id, 7)
        async with WorkspaceClient(
            url_of(server), token=token_for(WS), config=fast_client_config()
        ) as client:
            outcome = await client.wait_request(WS, answer.request_id, timeout=10)
            # Checked before yielding to the loop: released by the wait, not by a finalizer later.
            in_use = _in_use(client)
    assert outcome.result == 7
    assert in_use == 0


async def test_a_cancelled_wait_releases_its_stream_and_its_server_waiter(
    server: TestServer,
) -> None:
    assert server.app is not None
    waiters = server.app[WAITERS]
    async with direct(server) as qc:
        answer = await qc.enqueue(WS, stage="s", job_id="J1")
        async with WorkspaceClient(
            url_of(server), token=token_for(WS), config=fast_client_config()
        ) as client:
            waiting = asyncio.create_task(client.wait_request(WS, answer.request_id, timeout=30))
            await _until(lambda: waiters.count == 1)
            waiting.cancel()
            cancelled = await asyncio.gather(waiting, return_exceptions=True)
            in_use = _in_use(client)
            await _until(lambda: waiters.count == 0)  # the server saw the hang-up
        row = await qc.get_request(WS, answer.request_id)
    assert isinstance(cancelled[0], asyncio.CancelledError)
    assert in_use == 0
    assert row.status == "pending"  # the wait ended, never the work


async def test_a_redirected_enqueue_is_not_followed_and_is_retried_under_its_key(
    aiohttp_server: Callable[..., Any],
) -> None:
    # aiohttp followed redirects: a 302 turned the enqueue into a GET elsewhere, and a 307 sent
    # it wherever the redirect pointed, whose answer was taken. Not followed, it is retried.
    posts: list[str | None] = []
    elsewhere: list[str] = []

    async def requests(request: web.Request) -> web.Response:
        posts.append(request.headers.get("Idempotency-Key"))
        if len(posts) == 1:
            raise web.HTTPFound("/elsewhere")
        return web.json_response(
            {"request_id": "r1", "status": "pending", "coalesced": False, "stream_url": "/s"},
            status=202,
        )

    async def other(request: web.Request) -> web.Response:
        elsewhere.append(request.method)
        return web.json_response({"request_id": "wrong", "status": "done"}, status=200)

    app = web.Application()
    app.router.add_post(f"/v1/workspaces/{WS}/requests", requests)
    app.router.add_route("*", "/elsewhere", other)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    async with WorkspaceClient(url, token="t", config=fast_client_config()) as client:
        answer = await api.enqueue(client, WS, {"stage": "s"}, idempotency_key="key-1")
    assert answer.request_id == "r1"
    assert posts == ["key-1", "key-1"]
    assert elsewhere == []


# -- answers nested past what the JSON reader takes ------------------------------------------------


@pytest.mark.parametrize("status", [200, 503])
async def test_a_queue_answer_nested_too_deep_to_parse_is_typed_not_a_recursion_error(
    aiohttp_server: Callable[..., Any], status: int
) -> None:
    """A 200 is `ProtocolError` (retried, then raised typed); an error status is judged by the
    status alone. It reached the app as a bare `RecursionError`."""
    deep = "[" * 100_000 + "]" * 100_000
    calls = 0

    async def answer(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        return web.Response(status=status, text=deep, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/workspaces/{ws}/requests/{id}", answer)
    server = await aiohttp_server(app)
    config = dataclasses.replace(fast_client_config(), retry_attempts=2)
    async with api.QueueClient(url_of(server), token_for(WS), config=config) as qc:
        with pytest.raises(WorkspaceError) as caught:
            await asyncio.wait_for(api.get_request(qc, WS, "r1"), BOUND)
    assert caught.value.retryable
    assert calls == 2
