"""Cancelling a request, end to end (docs/queue.md): the route, the SDK's `cancel_request` and
`wait_request`, a real `Worker` stopped at its next heartbeat, the `cv-workspace` command, and
the unclaimed-wait figure on a request row — against a real server on loopback."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from cv_mutations import NodeInsert
from cv_server.keys import WAITERS
from cv_workspace_client import InvalidRequestError, NotFoundError, ProtocolError, WorkspaceClient
from cv_workspace_client._queue import holder as holder
from cv_workspace_client._queue import requester as api
from cv_workspace_client.cli.workspace import workspace_main
from cv_workspace_client.stage import StageContext
from cv_workspace_client.worker import Worker, WorkerConfig
from tests.worker.conftest import (
    WS,
    MakeServer,
    ServerFactory,
    fast_client_config,
    running,
    token_for,
    url_of,
)

FAST = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05)
#: Every wait below is bounded by this; the waits themselves ask for far longer, so a wait that
#: missed the cancel (and would sit out its own timeout) fails here instead of passing late.
BOUND = 15.0
LONG_WAIT = 120.0


async def _waiters_registered(server: TestServer, count: int) -> None:
    """Until `count` request waiters are parked on the server (a state, not a duration)."""
    assert server.app is not None
    async with asyncio.timeout(BOUND):
        while server.app[WAITERS].count < count:  # noqa: ASYNC110  (a state)
            await asyncio.sleep(0.005)


async def test_a_pending_request_is_cancelled_at_once_and_its_waiter_hears_it_at_once(
    client: WorkspaceClient, server: TestServer
) -> None:
    enqueued = await client.enqueue(WS, stage="nobody-serves-this", job_id="J1")
    waiting = asyncio.create_task(client.wait_request(WS, enqueued.request_id, LONG_WAIT))
    await _waiters_registered(server, 1)
    row = await client.cancel_request(WS, enqueued.request_id)
    assert (row.status, row.cancel_requested, row.is_finished) == ("cancelled", False, True)
    outcome = await asyncio.wait_for(waiting, BOUND)
    assert outcome.status == "cancelled"
    assert not outcome.ok
    assert outcome.request is not None
    assert outcome.request.status == "cancelled"
    # Cancelling again is answered with the row as it stands.
    again = await client.cancel_request(WS, enqueued.request_id)
    assert again.status == "cancelled"
    assert again.finished_at == row.finished_at
    # The SSE stream of a cancelled request says so in its own event.
    url = f"{url_of(server)}/v1/workspaces/{WS}/requests/{enqueued.request_id}/stream"
    async with (
        aiohttp.ClientSession() as session,
        session.get(url, headers={"Authorization": f"Bearer {token_for(WS)}"}) as response,
    ):
        text = await response.text()
    assert text.startswith("event: cancelled\n")
    assert json.loads(text.split("data: ", 1)[1])["status"] == "cancelled"


async def test_a_running_stage_stops_at_its_next_heartbeat_and_the_request_ends_cancelled(
    client: WorkspaceClient, server: TestServer
) -> None:
    started = asyncio.Event()
    stopped: list[str] = []
    runs = 0

    async def slow(ctx: StageContext) -> Any:
        nonlocal runs
        runs += 1
        await ctx.apply_op("tree", NodeInsert(node_id="written", parent_id="root"), key="w")
        started.set()
        try:
            await asyncio.Event().wait()  # until the worker stops it
        except asyncio.CancelledError:
            stopped.append("cancelled")
            raise
        return "never"

    config = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05, heartbeat_seconds=0.1)
    worker = Worker(client, {"slow": slow}, config=config)
    async with running(worker):
        enqueued = await client.enqueue(WS, stage="slow", job_id="J1")
        await asyncio.wait_for(started.wait(), BOUND)
        asked = await client.cancel_request(WS, enqueued.request_id)
        assert (asked.status, asked.cancel_requested) == ("in_progress", True)
        outcome = await asyncio.wait_for(
            client.wait_request(WS, enqueued.request_id, LONG_WAIT), BOUND
        )
    assert outcome.status == "cancelled"
    assert outcome.request is not None
    assert outcome.request.cancel_requested
    assert outcome.request.dequeue_count == 1
    assert outcome.error is not None
    assert outcome.error["code"] == "cancelled"
    assert stopped == ["cancelled"]
    assert runs == 1
    assert (worker.stats.cancelled, worker.stats.failed, worker.stats.completed) == (1, 0, 0)
    _, state = await client.get_state(WS, "tree")
    assert "written" in state.nodes  # a write committed before the cancel stays committed


async def test_done_and_unknown_requests_refuse_a_cancel(client: WorkspaceClient) -> None:
    async def quick(ctx: StageContext) -> Any:
        return "ok"

    async with running(Worker(client, {"quick": quick}, config=FAST)):
        enqueued = await client.enqueue(WS, stage="quick", job_id="J1")
        outcome = await client.wait_request(WS, enqueued.request_id, BOUND)
    assert outcome.status == "done"
    with pytest.raises(InvalidRequestError) as refused:
        await client.cancel_request(WS, enqueued.request_id)
    assert (refused.value.code, refused.value.status) == ("not_cancellable", 409)
    assert (await client.get_request(WS, enqueued.request_id)).status == "done"
    with pytest.raises(NotFoundError):
        await client.cancel_request(WS, "d_" + "0" * 40)


async def _cli(capsys: pytest.CaptureFixture[str], server: TestServer, *args: str) -> Any:
    argv = [*args, "--json", "--url", url_of(server), "--token", token_for(WS)]
    code = await asyncio.to_thread(workspace_main, argv)
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else json.loads(err)


async def test_the_shell_cancels_and_lists_cancelled_requests(
    capsys: pytest.CaptureFixture[str], client: WorkspaceClient, server: TestServer
) -> None:
    kept = await client.enqueue(WS, stage="nobody", job_id="kept")
    dropped = await client.enqueue(WS, stage="nobody", job_id="dropped")
    code, row = await _cli(
        capsys, server, "requests", "cancel", "--workspace", WS, dropped.request_id
    )
    assert code == 0
    assert (row["request_id"], row["status"]) == (dropped.request_id, "cancelled")
    code, listing = await _cli(
        capsys, server, "requests", "list", "--workspace", WS, "--status", "cancelled"
    )
    assert code == 0
    assert [r["request_id"] for r in listing["requests"]] == [dropped.request_id]
    rows = await client.list_requests(status="cancelled", workspace_id=WS)
    assert [r.request_id for r in rows] == [dropped.request_id]
    pending = await client.list_requests(status="pending", workspace_id=WS)
    assert [r.request_id for r in pending] == [kept.request_id]


async def test_a_request_no_worker_serves_says_how_long_it_waited_unclaimed(
    client: WorkspaceClient,
) -> None:
    before = time.time()
    enqueued = await client.enqueue(WS, stage="nobody", job_id="J1")
    first = await client.get_request(WS, enqueued.request_id)
    second = await client.get_request(WS, enqueued.request_id)
    elapsed = time.time() - before
    assert first.unclaimed_seconds is not None
    assert second.unclaimed_seconds is not None
    assert 0.0 <= first.unclaimed_seconds <= second.unclaimed_seconds <= elapsed
    (listed,) = await client.list_requests(workspace_id=WS)
    assert listed.unclaimed_seconds is not None
    assert listed.unclaimed_seconds >= second.unclaimed_seconds

    async def quick(ctx: StageContext) -> Any:
        return "ok"

    served = await client.enqueue(WS, stage="quick", job_id="J2")
    async with running(Worker(client, {"quick": quick}, config=FAST)):
        await client.wait_request(WS, served.request_id, BOUND)
    done = await client.get_request(WS, served.request_id)
    assert done.unclaimed_seconds is None  # a finished request waits for nothing


# -- the SDK's wait against a server that speaks of events it does not know ----------------------


def _row(status: str) -> dict[str, Any]:
    return {"request_id": "r1", "workspace_id": WS, "stage": "s", "status": status}


async def _newer_server(aiohttp_server: ServerFactory, status: str) -> tuple[TestServer, list[str]]:
    """A server whose stream announces the outcome in an event this SDK does not know, then
    ends; the row itself reads `status`."""
    hits: list[str] = []

    async def stream(request: web.Request) -> web.StreamResponse:
        hits.append("stream")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f"event: queued\ndata: {json.dumps(_row('pending'))}\n\n".encode())
        await response.write(f"event: archived\ndata: {json.dumps(_row(status))}\n\n".encode())
        await response.write_eof()
        return response

    async def get(request: web.Request) -> web.Response:
        hits.append("get")
        return web.json_response(_row(status))

    app = web.Application()
    app.router.add_get(f"/v1/workspaces/{WS}/requests/r1/stream", stream)
    app.router.add_get(f"/v1/workspaces/{WS}/requests/r1", get)
    return await aiohttp_server(app), hits


async def test_a_wait_reads_the_row_when_the_stream_ends_on_an_unknown_event(
    aiohttp_server: ServerFactory,
) -> None:
    server, hits = await _newer_server(aiohttp_server, "cancelled")
    async with WorkspaceClient(
        url_of(server), token=token_for(WS), config=fast_client_config()
    ) as client:
        outcome = await asyncio.wait_for(api.wait_request(client, WS, "r1", LONG_WAIT), BOUND)
    assert outcome.status == "cancelled"
    assert hits == ["stream", "get"]


async def test_a_wait_refuses_a_status_it_does_not_know_instead_of_calling_it_poison(
    aiohttp_server: ServerFactory,
) -> None:
    server, hits = await _newer_server(aiohttp_server, "archived")
    async with WorkspaceClient(
        url_of(server), token=token_for(WS), config=fast_client_config()
    ) as client:
        with pytest.raises(ProtocolError, match="unknown status 'archived'"):
            await asyncio.wait_for(api.wait_request(client, WS, "r1", LONG_WAIT), BOUND)
    assert hits == ["stream", "get"]


async def test_a_cancel_in_progress_on_a_server_with_a_short_lease_parks_when_the_worker_died(
    make_server: MakeServer,
) -> None:
    """The holder died (it never heartbeats again): the lapsed lease of a cancelled request
    ends it `cancelled` at the next claim, never hands it to a second worker."""
    server = await make_server(lease_seconds=0.3)
    async with WorkspaceClient(
        url_of(server), token=token_for(WS), config=fast_client_config()
    ) as client:
        enqueued = await client.enqueue(WS, stage="s", job_id="J1")
        (claimed,) = await holder.claim(client, ["s"], "dies-now", limit=1)
        assert claimed.request.request_id == enqueued.request_id
        asked = await client.cancel_request(WS, enqueued.request_id)
        assert asked.cancel_requested
        waiting = asyncio.create_task(client.wait_request(WS, enqueued.request_id, LONG_WAIT))
        runs = 0

        async def never(ctx: StageContext) -> Any:
            nonlocal runs
            runs += 1
            return "ran twice"

        async with running(Worker(client, {"s": never}, config=FAST)):
            outcome = await asyncio.wait_for(waiting, BOUND)
    assert outcome.status == "cancelled"
    assert runs == 0
