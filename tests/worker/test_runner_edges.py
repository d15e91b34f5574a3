"""The stage worker at its edges: a claim the server refuses for good, a stalled claim when SIGTERM
arrives, a `cv-worker` URL that can never work, and a compute lock whose holder is cancelled from
outside (lease lost, drain deadline) while its write is still on its way. Real server on loopback;
each test bounded, none sleeps to paper over a race."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from pydantic import JsonValue

from cv_mutations import NodeInsert
from cv_server import ServerConfig, create_app
from cv_workspace_client import WorkspaceClient
from cv_workspace_client._queue import requester as api
from cv_workspace_client.cli.conventions import EXIT_FAILED, EXIT_USAGE
from cv_workspace_client.compute import LockPolling, compute_once
from cv_workspace_client.errors import InvalidRequestError
from cv_workspace_client.stage import ExpectedError, StageContext, op_id_for
from cv_workspace_client.testing import FaultProxy
from cv_workspace_client.worker import Worker, WorkerConfig
from tests.compute.helpers import (
    FIELD,
    JOB,
    GatedProvider,
    SlowCellWrites,
    cell,
    cell_writes,
    compute_or_wait,
    fast_config,
    seed_job,
)
from tests.compute.helpers import WS as COMPUTE_WS
from tests.compute.helpers import token_for as compute_token_for
from tests.worker.conftest import (
    SECRET,
    WS,
    MakeServer,
    ServerFactory,
    fast_client_config,
    open_client,
    token_for,
    url_of,
)

BOUND = 10.0  # no test here may hang: every wait on a state is bounded by this
FAST = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05)


async def _echo(ctx: StageContext) -> Any:
    return ctx.input


async def _worker_process(*args: str, within: float = 20.0) -> tuple[int | None, str]:
    """Run `cv-worker ARGS`; (exit code, stderr). Exit code None: still running after `within`
    seconds (it was killed)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cv_workspace_client.cli", "worker", *args, "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        _, err = await asyncio.wait_for(proc.communicate(), within)
        return proc.returncode, err.decode()
    except TimeoutError:
        proc.kill()
        _, err = await proc.communicate()
        return None, err.decode()


# -- a claim refused for good ----------------------------------------------------------------------


async def test_a_claim_refused_with_a_final_4xx_ends_the_run_instead_of_retrying_forever(
    server: TestServer,
) -> None:
    # The server caps class names at 64 chars (and worker ids at 256): every claim of this
    # worker is answered 422, and always will be. A final 4xx is never retried (docs/client.md); a
    # worker that kept claiming logged a warning every 2 s forever and ran nothing — not even
    # its other, valid stage — while looking alive to its supervisor.
    async with open_client(server) as client:
        await api.enqueue(client, WS, {"stage": "echo", "job_id": "J1", "input": 1})
        worker = Worker(client, {"echo": _echo, "x" * 65: _echo}, config=FAST)
        run = asyncio.create_task(worker.run())
        try:
            with pytest.raises(InvalidRequestError) as refused:
                await asyncio.wait_for(asyncio.shield(run), BOUND)
        finally:
            worker.stop()
            await asyncio.wait_for(asyncio.gather(run, return_exceptions=True), BOUND)
        assert refused.value.code == "invalid_field"
        assert worker.stats.claimed == 0


async def test_cv_worker_exits_1_with_the_error_when_the_server_refuses_its_claims(
    server: TestServer,
) -> None:
    # The command's contract: exit 1 when the server refuses; a worker id over the server's
    # 256-char limit is refused on every claim.
    code, err = await _worker_process(
        "--url", url_of(server), "--token", token_for(WS),
        "--stages", "tests.worker.cli_stages:STAGES", "--worker-id", "w" * 257,
    )  # fmt: skip
    assert code == EXIT_FAILED, err[-2000:]
    assert json.loads(err.strip().splitlines()[-1])["error"]["code"] == "invalid_field"


@pytest.mark.parametrize("url", ["notaurl", "ftp://127.0.0.1:1", "http://", "http://[::1"])
async def test_cv_worker_refuses_a_url_it_can_never_reach_as_a_usage_error(url: str) -> None:
    # Such a URL fails every claim before a byte is sent; the worker retried it forever (exit
    # only by signal) instead of saying what was wrong (exit 2, like every other bad argument).
    code, err = await _worker_process(
        "--url", url, "--token", "t", "--stages", "tests.worker.cli_stages:STAGES"
    )  # fmt: skip
    assert code == EXIT_USAGE, err[-2000:]
    error = json.loads(err.strip().splitlines()[-1])["error"]
    assert error["code"] == "usage"
    assert "--url" in error["message"]


# -- an expected error is an acknowledgement too -------------------------------------------------


async def test_an_expected_error_is_not_acknowledged_before_the_runs_writes_committed(
    aiohttp_server: ServerFactory, tmp_path: Any
) -> None:
    # The handler spawns a write and then answers with an `ExpectedError`. Its completion is an
    # acknowledgement like any other (done, final, never retried): it must wait for the write,
    # and a write whose retries ran out (StillPendingError: waiting in the outbox, uncommitted)
    # must fail the run rather than be acknowledged — as on the success path (docs/client.md: never
    # ack before the work's writes committed). The re-drive writes under the same op_id.
    refused: list[str] = []

    @web.middleware
    async def flaky_ops(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if (
            request.method == "POST"
            and request.path.endswith("/docs/flaky/ops")
            and len(refused) < 2
        ):
            refused.append(request.path)
            return web.json_response({"code": "unavailable", "detail": "injected"}, status=503)
        return await handler(request)

    app = create_app(
        ServerConfig(db_path=tmp_path / "s.db", token_secret=SECRET, failure_backoff_seconds=0.0)
    )
    app.middlewares.append(flaky_ops)
    server = await aiohttp_server(app)
    runs: list[int] = []
    spawned: list[asyncio.Task[Any]] = []

    async def marks_then_refuses(ctx: StageContext) -> Any:
        runs.append(ctx.request.dequeue_count)
        spawned.append(
            asyncio.create_task(
                ctx.apply_op("flaky", NodeInsert(node_id="n", parent_id="root"), key="mark")
            )
        )
        raise ExpectedError("bad_input", "refused after marking the job")

    config = replace(fast_client_config(), retry_attempts=2, ops_over_websocket=False)
    async with WorkspaceClient(url_of(server), token=token_for(WS), config=config) as client:
        worker = Worker(client, {"w": marks_then_refuses}, config=FAST)
        run = asyncio.create_task(worker.run())
        try:
            answer = await api.enqueue(client, WS, {"stage": "w", "job_id": "J1"})
            outcome = await api.wait_request(client, WS, answer.request_id, timeout=BOUND)
            # Done only once the write is in the log.
            _, entries = await client.read_ops(WS, "flaky", since=0, limit=100)
        finally:
            worker.stop()
            await asyncio.wait_for(asyncio.gather(run, return_exceptions=True), BOUND)
            await asyncio.gather(*spawned, return_exceptions=True)
    assert outcome.status == "done"
    assert outcome.error is not None
    assert outcome.error["code"] == "bad_input"
    assert len(refused) == 2
    assert runs == [1, 2]
    assert [e.op_id for e in entries] == [op_id_for(answer.request_id, 1, "mark")]


# -- SIGTERM while a claim is stalled --------------------------------------------------------------


async def _stalling_claims(
    aiohttp_server: ServerFactory, tmp_path: Any
) -> tuple[TestServer, asyncio.Event, asyncio.Event]:
    """A server whose claims stall until `release` is set (`entered`: one arrived)."""
    entered = asyncio.Event()
    release = asyncio.Event()

    @web.middleware
    async def stall_claims(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path == "/v1/queue/claim" and not release.is_set():
            entered.set()
            await release.wait()
        return await handler(request)

    app = create_app(ServerConfig(db_path=tmp_path / "cv.db", token_secret=SECRET))
    app.middlewares.append(stall_claims)
    return await aiohttp_server(app), entered, release


async def test_stop_during_a_stalled_claim_returns_within_the_drain_deadline(
    aiohttp_server: ServerFactory, tmp_path: Any
) -> None:
    # The drain ends within its deadline (25 s, under Kubernetes' 30 s grace). A
    # claim whose answer never comes (a stalled server or link) held `stop()` for the client's
    # whole request timeout (5 min by default): the worker was SIGKILLed mid-drain instead.
    server, entered, release = await _stalling_claims(aiohttp_server, tmp_path)
    drain = 0.3
    async with open_client(server) as client:
        worker = Worker(
            client,
            {"echo": _echo},
            # The stall is on the HTTP claim route.
            config=WorkerConfig(idle_initial_seconds=0.01, drain_seconds=drain, transport="http"),
        )
        run = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(entered.wait(), BOUND)
            worker.stop()
            # Back with its claim still unanswered (the server holds it until `release`): the
            # drain did not wait for it. The bound only tells the drain (0.3 s) from the
            # request timeout (5 min).
            stats = await asyncio.wait_for(asyncio.shield(run), BOUND)
            assert not release.is_set()
            assert stats.claimed == 0
        finally:
            release.set()  # the test's own cleanup: let the stalled handler end
            await asyncio.wait_for(asyncio.gather(run, return_exceptions=True), BOUND)


async def test_a_claim_answered_just_after_stop_still_runs_what_it_claimed(
    aiohttp_server: ServerFactory, tmp_path: Any
) -> None:
    # The other side of the bound above: a claim that answers within the drain deadline is
    # not abandoned — the rows it leased are this worker's, and are run and completed now,
    # not left leased to nobody for a whole lease.
    server, entered, release = await _stalling_claims(aiohttp_server, tmp_path)
    async with open_client(server) as client:
        answer = await api.enqueue(client, WS, {"stage": "echo", "job_id": "J1", "input": 7})
        http = WorkerConfig(idle_initial_seconds=0.01, transport="http")  # the HTTP claim's stall
        worker = Worker(client, {"echo": _echo}, config=http)
        run = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(entered.wait(), BOUND)
            worker.stop()
            await asyncio.sleep(0)  # let stop() reach the claim loop first
            release.set()
            stats = await asyncio.wait_for(asyncio.shield(run), BOUND)
        finally:
            release.set()
            await asyncio.wait_for(asyncio.gather(run, return_exceptions=True), BOUND)
        assert (stats.claimed, stats.completed) == (1, 1)
        row = await api.get_request(client, WS, answer.request_id)
        assert (row.status, row.result) == ("done", 7)


# -- the compute lock of a holder cancelled from outside ----------------------------------------


async def test_a_holder_cancelled_mid_write_keeps_the_key_until_its_write_can_land(
    aiohttp_server: ServerFactory, tmp_path: Any
) -> None:
    # A stage whose heartbeat was answered `lease_lost` (or whose drain deadline passed) is
    # cancelled. If that lands while its compute's write is on its way — paid for, sent, not yet
    # committed: a cancelled `apply_op` does not unsend the op (docs/client.md) — releasing the lock
    # on the way out let the worker that re-drove the request take the key, double-check before
    # the write landed, and pay for the same call again (once, however many race).
    slow = SlowCellWrites()
    url = await slow.serve(aiohttp_server, tmp_path / "slow.db")  # the real 60 s lock TTL
    token = compute_token_for(COMPUTE_WS)
    async with (
        WorkspaceClient(url, token=token, config=fast_config(ops_over_websocket=False)) as mine,
        WorkspaceClient(url, token=token, config=fast_config()) as theirs,
    ):
        await seed_job(mine)
        provider = GatedProvider()
        provider.gate.set()
        check, compute = cell(mine, provider)
        holder = asyncio.create_task(
            compute_once(mine, COMPUTE_WS, JOB, FIELD, check=check, compute=compute, holder="a")
        )
        try:
            await asyncio.wait_for(slow.held.wait(), BOUND)  # paid, and the write is on its way
            waiter = asyncio.create_task(
                compute_or_wait(
                    theirs,
                    provider,
                    "b",
                    wait=BOUND,
                    polling=LockPolling(initial_seconds=0.02, max_seconds=0.1),
                )
            )
            await slow.acquisitions.reach(2)  # the waiter found the key locked
            holder.cancel()  # what the heartbeat's `lease_lost` (or the drain deadline) does
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(holder, BOUND)
            # The waiter's next poll. Had the key been handed back, it wins it: let it get as
            # far as its double-check and provider call before the slow write lands.
            polls = slow.acquisitions.value
            await slow.acquisitions.reach(polls + 1)
            if slow.granted[polls]:
                await provider.arrived.reach(2)
            slow.let_go.set()  # the write commits, long inside the holder's lock TTL
            result = await asyncio.wait_for(waiter, BOUND)
        finally:
            slow.let_go.set()
            if not holder.done():
                holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)
        assert provider.calls == 1
        assert result.status == "present"
        value: JsonValue = result.value
        assert value is not None
        assert await cell_writes(theirs) == 1


# -- a heartbeat on a connection that went silent ------------------------------------------------


async def test_a_heartbeat_on_a_silently_dead_connection_still_keeps_the_lease(
    make_server: MakeServer,
) -> None:
    # A NAT that forgot the flow, or a peer that lost power: the pooled keep-alive connection
    # the next heartbeat goes out on is silent, neither answered nor reset. The beat waited for
    # the client's request timeout; the lease lapsed meanwhile and a second worker re-drove
    # the request while the first still ran it (two runs, docs/queue.md: heartbeat while running).
    # Now a beat unanswered after half the interval is abandoned and sent again at once.
    # Beats every 0.2 s under a lease that cannot lapse within the test's bound: a beat stuck on
    # the silent connection shows as no renewal within the bound, not as a race with the lapse.
    server = await make_server(lease_seconds=BOUND * 3)
    release = asyncio.Event()
    started = asyncio.Event()

    async def slow(ctx: StageContext) -> Any:
        started.set()
        await release.wait()
        return "first"

    async with (
        FaultProxy(url_of(server)) as proxy,
        WorkspaceClient(proxy.url, token=token_for(WS), config=fast_client_config()) as first,
        open_client(server) as second,
    ):
        answer = await api.enqueue(second, WS, {"stage": "slow", "job_id": "J1"})
        # A short drain: its completion may go out on another silent pooled connection.
        one = Worker(
            first, {"slow": slow}, config=replace(FAST, drain_seconds=1.0, heartbeat_seconds=0.2)
        )
        two = Worker(second, {"slow": _echo}, config=FAST)
        runs = [asyncio.create_task(one.run())]
        try:
            await asyncio.wait_for(started.wait(), BOUND)

            async def lease() -> tuple[str | None, float | None]:
                row = await api.get_request(second, WS, answer.request_id)
                return row.claimed_by, row.lease_expires_at

            claimed = await lease()
            async with asyncio.timeout(BOUND):  # the first beat renewed it: a pooled connection
                while await lease() == claimed:  # noqa: ASYNC110  (a state)
                    await asyncio.sleep(0.02)
            assert proxy.silence_open() >= 1
            silenced = await lease()
            runs.append(asyncio.create_task(two.run()))  # ready to re-drive a lapsed lease
            async with asyncio.timeout(BOUND):  # renewed by `one` again, on a fresh connection
                while (now := await lease()) == silenced:  # noqa: ASYNC110  (a state)
                    await asyncio.sleep(0.02)
            assert now[0] == one.worker_id, "the lease lapsed and another worker took it"
            assert two.stats.claimed == 0
            release.set()
        finally:
            release.set()
            one.stop()
            two.stop()
            await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), BOUND)
