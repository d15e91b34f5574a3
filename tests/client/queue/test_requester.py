"""The typed queue calls and `QueueMethods` (enqueue, wait, inspect) against a real server, and the
SSE wait's reconnects against a server that drops streams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from cv_workspace_client._queue import holder as holder
from cv_workspace_client._queue import requester as api
from cv_workspace_client.errors import InvalidRequestError, NotFoundError
from cv_workspace_client.stage import LeaseLostError
from tests.worker.conftest import (
    WS,
    MakeServer,
    ServerFactory,
    fast_client_config,
    token_for,
    url_of,
)


@asynccontextmanager
async def queue_client(server: TestServer) -> AsyncIterator[api.QueueClient]:
    async with api.QueueClient(url_of(server), token_for(WS), config=fast_client_config()) as qc:
        yield qc


class StreamCounter:
    """Counts SSE connections the client opens (an aiohttp trace), and wakes waiters at each."""

    def __init__(self) -> None:
        self.count = 0
        self.changed = asyncio.Event()
        self.trace = aiohttp.TraceConfig()
        self.trace.on_request_start.append(self._started)

    async def _started(
        self, session: Any, ctx: Any, params: aiohttp.TraceRequestStartParams
    ) -> None:
        if params.url.path.endswith("/stream"):
            self.count += 1
            self.changed.set()

    async def reach(self, count: int, within: float = 10.0) -> None:
        async with asyncio.timeout(within):
            while self.count < count:
                self.changed.clear()
                await self.changed.wait()


async def _claim_one(qc: api.QueueClient, worker_class: str = "s") -> holder.Claim:
    claims = await holder.claim(qc, [worker_class], "tester")
    assert len(claims) == 1
    return claims[0]


async def test_a_waiter_past_its_deadline_gets_timeout_and_later_the_result(
    server: TestServer,
) -> None:
    async with queue_client(server) as qc:
        answer = await qc.enqueue(WS, stage="s", job_id="J1")
        outcome = await qc.wait_request(WS, answer.request_id, timeout=0.2)
        assert outcome.timed_out
        assert outcome.status == "timeout"
        assert outcome.request_id == answer.request_id
        assert outcome.request is not None
        assert outcome.request.status == "pending"
        claimed = await _claim_one(qc)
        await holder.complete(qc, WS, answer.request_id, claimed.claim_token, result={"late": True})
        later = await qc.wait_request(WS, answer.request_id, timeout=10)
    assert later.status == "done"
    assert later.ok
    assert later.result == {"late": True}


async def test_a_wait_longer_than_the_server_deadline_reconnects_until_done(
    make_server: MakeServer,
) -> None:
    server = await make_server(waiter_deadline_seconds=0.1)
    counter = StreamCounter()
    async with (
        aiohttp.ClientSession(trace_configs=[counter.trace]) as session,
        api.QueueClient(url_of(server), token_for(WS), session=session) as qc,
    ):
        answer = await qc.enqueue(WS, stage="s", job_id="J1")
        waiting = asyncio.create_task(qc.wait_request(WS, answer.request_id, timeout=30))
        await counter.reach(3)  # the server ended two streams with TIMEOUT; the client came back
        claimed = await _claim_one(qc)
        await holder.complete(qc, WS, answer.request_id, claimed.claim_token, result=5)
        outcome = await asyncio.wait_for(waiting, 10)
    assert outcome.status == "done"
    assert outcome.result == 5


async def test_a_dropped_stream_reconnects_and_loses_nothing(
    aiohttp_server: ServerFactory,
) -> None:
    row = {
        "request_id": "r1",
        "workspace_id": WS,
        "stage": "s",
        "status": "pending",
        "run": 1,
        "dequeue_count": 0,
    }
    connections = 0

    async def stream(request: web.Request) -> web.StreamResponse:
        nonlocal connections
        connections += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f"event: queued\ndata: {json.dumps(row)}\n\n".encode())
        if connections == 1:
            assert request.transport is not None
            request.transport.close()  # the connection drops mid-wait
            return response
        done = {**row, "status": "done", "result": {"ok": 1}}
        await response.write(f"event: done\ndata: {json.dumps(done)}\n\n".encode())
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/v1/workspaces/{ws}/requests/{id}/stream", stream)
    fake = await aiohttp_server(app)
    async with queue_client(fake) as qc:
        outcome = await qc.wait_request(WS, "r1", timeout=10)
    assert connections == 2
    assert outcome.status == "done"
    assert outcome.result == {"ok": 1}


async def test_the_old_holders_heartbeat_and_complete_raise_lease_lost(
    make_server: MakeServer,
) -> None:
    server = await make_server(lease_seconds=0.05)
    async with queue_client(server) as qc:
        answer = await qc.enqueue(WS, stage="s", job_id="J1")
        old = await _claim_one(qc)
        async with asyncio.timeout(10):
            # Until the lease lapsed and the row is claimable again (a state, not a duration).
            while not (claims := await holder.claim(qc, ["s"], "rescuer")):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        new = claims[0]
        with pytest.raises(LeaseLostError):
            await holder.heartbeat(qc, WS, answer.request_id, old.claim_token)
        with pytest.raises(LeaseLostError):
            await holder.complete(qc, WS, answer.request_id, old.claim_token, result="stale")
        with pytest.raises(LeaseLostError):
            await holder.fail(qc, WS, answer.request_id, old.claim_token, {"code": "x"})
        (refused,) = await holder.complete_many(
            qc, [{"request_id": answer.request_id, "claim_token": old.claim_token}]
        )
        assert isinstance(refused.error, LeaseLostError)
        assert await holder.complete(qc, WS, answer.request_id, new.claim_token, result="fresh")
        row = await qc.get_request(WS, answer.request_id)
    assert row.status == "done"
    assert row.result == "fresh"
    assert row.claimed_by == "rescuer"


async def test_enqueue_coalesces_deterministic_requests_and_keys_the_others(
    server: TestServer,
) -> None:
    async with queue_client(server) as qc:
        first = await qc.enqueue(WS, stage="s", job_id="J1", input={"a": 1})
        again = await qc.enqueue(WS, stage="s", job_id="J1", input={"a": 1})
        loose_1 = await qc.enqueue(WS, stage="s", input={"a": 1})
        loose_2 = await qc.enqueue(WS, stage="s", input={"a": 1})
        keyed_1 = await qc.enqueue(WS, stage="s", input={"a": 2}, idempotency_key="k")
        keyed_2 = await qc.enqueue(WS, stage="s", input={"a": 2}, idempotency_key="k")
        with pytest.raises(InvalidRequestError) as reused:
            await qc.enqueue(WS, stage="s", input={"a": 3}, idempotency_key="k")
    assert not first.coalesced
    assert again.coalesced
    assert again.request_id == first.request_id
    assert loose_1.request_id != loose_2.request_id
    assert keyed_2.replayed
    assert keyed_2.request_id == keyed_1.request_id
    assert reused.value.code == "idempotency_key_reuse"


async def test_operators_list_and_replay_a_poisoned_request(make_server: MakeServer) -> None:
    server = await make_server(failure_backoff_seconds=0.0)
    async with queue_client(server) as qc:
        answer = await qc.enqueue(WS, stage="s", job_id="J1", max_dequeues=1)
        claimed = await _claim_one(qc)
        status, _ = await holder.fail(qc, WS, answer.request_id, claimed.claim_token, {"code": "E"})
        assert status == "poison"
        poisoned = await qc.list_requests(status="poison", workspace_id=WS)
        replayed = await qc.replay_request(WS, answer.request_id)
        with pytest.raises(InvalidRequestError) as not_poison:
            await qc.replay_request(WS, answer.request_id)
        with pytest.raises(NotFoundError):
            await qc.get_request(WS, "d_missing")
    assert [row.request_id for row in poisoned] == [answer.request_id]
    assert replayed.status == "pending"
    assert replayed.dequeue_count == 0
    assert not_poison.value.code == "invalid_transition"


async def test_operators_discard_a_poisoned_request_for_good(make_server: MakeServer) -> None:
    server = await make_server()
    async with queue_client(server) as qc:
        answer = await qc.enqueue(WS, stage="s", job_id="J1", max_dequeues=1)
        claimed = await _claim_one(qc)
        status, _ = await holder.fail(qc, WS, answer.request_id, claimed.claim_token, {"code": "E"})
        assert status == "poison"
        live = await qc.enqueue(WS, stage="s", job_id="J2")
        with pytest.raises(InvalidRequestError) as not_poison:
            await qc.discard_request(WS, live.request_id)
        discarded = await qc.discard_request(WS, answer.request_id)
        with pytest.raises(NotFoundError):
            await qc.get_request(WS, answer.request_id)
        with pytest.raises(NotFoundError):
            await qc.discard_request(WS, answer.request_id)
        remaining = await qc.list_requests(workspace_id=WS)
    assert (discarded.request_id, discarded.status) == (answer.request_id, "poison")
    assert not_poison.value.code == "not_discardable"
    assert [row.request_id for row in remaining] == [live.request_id]


async def test_reads_are_retried_on_a_5xx_and_a_4xx_is_final(
    aiohttp_server: ServerFactory,
) -> None:
    hits: list[str] = []
    row = {"request_id": "r1", "workspace_id": WS, "stage": "s", "status": "done", "result": 1}

    async def get(request: web.Request) -> web.Response:
        hits.append(request.match_info["id"])
        if request.match_info["id"] == "gone":
            return web.json_response({"code": "not_found", "status": 404}, status=404)
        if len(hits) < 3:
            return web.json_response({"code": "unavailable", "status": 503}, status=503)
        return web.json_response(row)

    app = web.Application()
    app.router.add_get("/v1/workspaces/{ws}/requests/{id}", get)
    fake = await aiohttp_server(app)
    async with queue_client(fake) as qc:
        got = await qc.get_request(WS, "r1")
        assert got.result == 1
        assert hits == ["r1", "r1", "r1"]
        with pytest.raises(NotFoundError):
            await qc.get_request(WS, "gone")
    assert hits[3:] == ["gone"]


async def test_every_request_is_listed_once_in_order_across_pages(make_server: MakeServer) -> None:
    server = await make_server()
    async with queue_client(server) as qc:
        enqueued = [(await qc.enqueue(WS, stage="s", job_id=f"J{i}")).request_id for i in range(25)]
        first_page = await qc.list_requests(workspace_id=WS, limit=10)
        listed = [row.request_id async for row in qc.iter_requests(workspace_id=WS, page=10)]
        pending = [
            row.request_id
            async for row in qc.iter_requests(status="pending", workspace_id=WS, page=7)
        ]
    assert [row.request_id for row in first_page] == enqueued[:10]
    assert listed == enqueued  # 10 + 10 + 5: each once, oldest first
    assert pending == enqueued
