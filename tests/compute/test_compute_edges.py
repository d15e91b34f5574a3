"""`compute_once` at its edges: a busy sub-doc, a dead holder process, a holder cancelled mid-call,
timeouts that are not the lock's, lock and write routes that answer 5xx, and single-flight
followers that give up. Each test counts provider calls: the number that must stay at one."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from pydantic import JsonValue

from cv_mutations import NodeIncrement, NodeInsert
from cv_server import ServerConfig, create_app
from cv_workspace_client.compute import (
    ComputeResult,
    LockExpiringError,
    LockPolling,
    acquire_lock,
    compute_once,
)
from cv_workspace_client.worker.parts import SingleFlight
from tests.clocks import SkippingClock

from .conftest import OpenClient, ServerFactory
from .helpers import (
    FIELD,
    JOB,
    JOBS,
    LOCK_TTL,
    SECRET,
    WS,
    GatedProvider,
    RequestLog,
    SlowCellWrites,
    Watched,
    cell,
    cell_writes,
    compute_or_wait,
    fast_config,
    holder_process,
    seed_job,
    stalled_after_acquiring,
    timed,
)

FAST_POLL = LockPolling(initial_seconds=0.02, max_seconds=0.1)
#: What a stalled holder has left of its compute budget: time enough for the provider's answer
#: and the write to reach the server, which then holds the write until the budget is gone.
WRITE_BUDGET = 5.0


# -- waiting for a dead holder ---------------------------------------------------------------------


async def test_a_waiter_takes_over_a_dead_holders_lock_while_the_sub_doc_keeps_changing(
    server_url: str, open_client: OpenClient, request_log: RequestLog, lock_clock: SkippingClock
) -> None:
    # The `jobs` sub-doc of a busy workspace never stops changing (other cells, other jobs).
    # Every change wakes the waiter, finds its cell still empty — and must not stop it from
    # polling the lock: a dead holder's lock lapses at its TTL and the waiter takes it over then,
    # not at the end of its wait (the stage would fail `compute_locked` and be re-driven later).
    client = await open_client(server_url)
    await seed_job(client)
    await client.apply_op(WS, JOBS, NodeInsert(node_id="busy", parent_id="root"))
    dead = await acquire_lock(client, WS, JOB, FIELD, "sigkilled-worker")  # never released
    assert dead.acquired
    provider = GatedProvider()
    provider.gate.set()
    read, compute = cell(client, provider)
    started: list[float] = []

    async def check() -> JsonValue | None:
        # Another worker's write lands on the sub-doc before each of our reads.
        await client.apply_op(WS, JOBS, NodeIncrement(node_id="busy", field="n"))
        return await read()

    waiter = asyncio.create_task(
        compute_or_wait(
            client,
            provider,
            "w",
            wait=LOCK_TTL,
            polling=FAST_POLL,
            check=check,
            compute=timed(compute, started),
        )
    )
    # Woken by every change, it still polls: its first acquisition and two polls, refused.
    await request_log.wait_for(lambda log: len(log.locked) >= 3)
    lapsed_at = time.time()
    lock_clock.skip(LOCK_TTL)  # the dead holder's lock lapses now

    async with asyncio.timeout(10):  # at its next poll, not only at the end of its wait
        result = await waiter

    assert result.status == "computed"
    assert provider.calls == 1
    assert started[0] >= lapsed_at  # not before the dead holder's lock lapsed


async def test_a_holder_process_sigkilled_mid_call_is_taken_over_once_after_its_ttl(
    server_url: str,
    open_client: OpenClient,
    request_log: RequestLog,
    lock_clock: SkippingClock,
    tmp_path: Path,
) -> None:
    client = await open_client(server_url)
    await seed_job(client)
    async with holder_process(server_url, tmp_path) as proc:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            line = await proc.stdout.readline()
        assert line.strip() == b"calling"
    assert proc.returncode == -signal.SIGKILL
    held = await acquire_lock(client, WS, JOB, FIELD, "probe")  # the dead holder's lock
    assert not held.acquired
    assert held.holder is not None
    assert held.holder.startswith("doomed#")
    provider = GatedProvider()
    provider.gate.set()
    _, compute = cell(client, provider)
    started: list[float] = []

    waiter = asyncio.create_task(
        compute_or_wait(
            client,
            provider,
            "next",
            wait=LOCK_TTL,
            polling=FAST_POLL,
            compute=timed(compute, started),
        )
    )
    await request_log.wait_for(lambda log: len(log.locked) >= 2)  # the probe, and the waiter
    lapsed_at = time.time()
    lock_clock.skip(LOCK_TTL)  # the dead holder's lock lapses now

    async with asyncio.timeout(10):  # at the waiter's next poll, not at the end of its wait
        result = await waiter

    assert result.status == "computed"
    assert provider.calls == 1  # the survivors pay once (the dead one's call is lost with it)
    assert started[0] >= lapsed_at
    assert await cell_writes(client) == 1


async def test_a_holder_cancelled_mid_call_releases_its_lock_for_the_waiter_at_once(
    server_url: str, open_client: OpenClient, request_log: RequestLog
) -> None:
    # A stage cancelled mid-call (its queue lease was lost, or the drain deadline passed) must
    # give the key back on its way out: the waiter takes over now, not after the 60 s TTL.
    clients = [await open_client(server_url) for _ in range(2)]
    await seed_job(clients[0])
    provider = GatedProvider()
    check, compute = cell(clients[0], provider)
    holder = asyncio.create_task(
        compute_once(clients[0], WS, JOB, FIELD, check=check, compute=compute, holder="a")
    )
    await provider.arrived.reach(1)
    waiter = asyncio.create_task(
        compute_or_wait(clients[1], provider, "b", wait=10, polling=FAST_POLL)
    )
    await request_log.wait_locked(JOB, FIELD)
    holder.cancel()
    with pytest.raises(asyncio.CancelledError):
        await holder
    await provider.arrived.reach(2)
    provider.gate.set()

    result = await asyncio.wait_for(waiter, 10)

    assert result.status == "computed"
    assert provider.calls == 2  # the cancelled call was paid; the waiter's is the only other
    assert request_log.count("/locks/release") == 2
    assert await cell_writes(clients[0]) == 1


# -- timeouts that are not the lock's --------------------------------------------------------------


async def test_a_timeout_raised_by_the_compute_itself_is_not_reported_as_an_outrun_lock(
    server_url: str, open_client: OpenClient
) -> None:
    # A provider (or a write) timing out on its own, seconds into a 60 s lock, is the compute's
    # failure: it must surface as such, not as `compute_lock_expiring` ("cancelled before the
    # lock could lapse"), which sends whoever reads the logs after the wrong cause.
    client = await open_client(server_url)
    await seed_job(client)
    provider = GatedProvider()
    check, _ = cell(client, provider)

    async def timing_out() -> JsonValue:
        raise TimeoutError("provider read timed out")

    with pytest.raises(TimeoutError, match="provider read timed out") as raised:
        await compute_once(client, WS, JOB, FIELD, check=check, compute=timing_out, holder="w")

    assert not isinstance(raised.value, LockExpiringError)
    assert (await acquire_lock(client, WS, JOB, FIELD, "next")).acquired  # released


# -- lock and write routes answering 5xx -----------------------------------------------------------


class Faults:
    """Server-side faults by route suffix: answer `status` for the next `n` requests, either
    instead of the handler (`before`) or after the handler ran and committed (`after`)."""

    def __init__(self) -> None:
        self.plan: dict[str, tuple[int, int, bool]] = {}
        self.injected: dict[str, int] = {}

    def fail(self, suffix: str, status: int, n: int, *, after: bool) -> None:
        self.plan[suffix] = (status, n, after)

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        for suffix, (status, n, after) in self.plan.items():
            if request.method == "POST" and request.path.endswith(suffix) and n > 0:
                self.plan[suffix] = (status, n - 1, after)
                self.injected[suffix] = self.injected.get(suffix, 0) + 1
                if after:
                    await handler(request)  # committed; the answer is then lost to a 5xx
                problem = {"type": "about:blank", "code": "unavailable", "title": "injected"}
                return web.json_response(
                    problem, status=status, content_type="application/problem+json"
                )
        return await handler(request)


@asynccontextmanager
async def faulty_server(
    aiohttp_server: ServerFactory, tmp_path: Path, faults: Faults
) -> AsyncIterator[str]:
    config = ServerConfig(db_path=tmp_path / "faults.db", token_secret=SECRET)
    app = create_app(config)
    app.middlewares.insert(0, faults.middleware)
    server = await aiohttp_server(app)
    yield str(server.make_url("")).rstrip("/")


async def test_a_write_answered_5xx_after_it_committed_is_retried_without_paying_again(
    aiohttp_server: ServerFactory, tmp_path: Path, open_client: OpenClient
) -> None:
    faults = Faults()
    async with faulty_server(aiohttp_server, tmp_path, faults) as url:
        client = await open_client(url, config=fast_config(ops_over_websocket=False))
        await seed_job(client)
        provider = GatedProvider()
        provider.gate.set()
        check, compute = cell(client, provider)
        faults.fail("/docs/jobs/ops", 503, 2, after=True)

        result = await compute_once(
            client, WS, JOB, FIELD, check=check, compute=compute, holder="w"
        )

        assert faults.injected["/docs/jobs/ops"] == 2
        assert result == ComputeResult("computed", result.value)
        assert provider.calls == 1
        assert await cell_writes(client) == 1  # the retries were deduped under one op_id
        again = await compute_once(client, WS, JOB, FIELD, check=check, compute=compute, holder="x")
        assert again == ComputeResult("present", result.value)
        assert provider.calls == 1


async def test_a_release_the_server_keeps_refusing_loses_neither_the_value_nor_the_key(
    aiohttp_server: ServerFactory, tmp_path: Path, open_client: OpenClient
) -> None:
    faults = Faults()
    async with faulty_server(aiohttp_server, tmp_path, faults) as url:
        client = await open_client(url)
        await seed_job(client)
        provider = GatedProvider()
        provider.gate.set()
        check, compute = cell(client, provider)
        attempts = client.config.retry_attempts
        faults.fail("/locks/release", 500, attempts, after=False)

        result = await compute_once(
            client, WS, JOB, FIELD, check=check, compute=compute, holder="w"
        )

        assert faults.injected["/locks/release"] == attempts  # every retry refused
        assert result.status == "computed"  # the release failing does not hide the result
        assert provider.calls == 1
        # The lock stays until its TTL, but the value is there: the next caller's pre-flight
        # finds it without touching the lock, so nobody pays or waits.
        other = await open_client(url)
        other_check, other_compute = cell(other, provider)
        again = await compute_once(
            other, WS, JOB, FIELD, check=other_check, compute=other_compute, holder="x"
        )
        assert again == ComputeResult("present", result.value)
        assert provider.calls == 1
        assert not (await acquire_lock(other, WS, JOB, FIELD, "probe")).acquired


async def test_an_acquisition_answered_5xx_after_the_server_took_the_lock_computes_once(
    aiohttp_server: ServerFactory, tmp_path: Path, open_client: OpenClient
) -> None:
    faults = Faults()
    async with faulty_server(aiohttp_server, tmp_path, faults) as url:
        client = await open_client(url)
        await seed_job(client)
        provider = GatedProvider()
        provider.gate.set()
        check, compute = cell(client, provider)
        faults.fail("/locks/acquire", 502, 1, after=True)
        other = await open_client(url)
        other_check, other_compute = cell(other, provider)

        result = await compute_once(
            client, WS, JOB, FIELD, check=check, compute=compute, holder="w"
        )
        # A racer arriving before the value's broadcast: still locked by the first call (its
        # token was lost with the 502, so the lock lapses at its TTL instead of being released).
        racer = await acquire_lock(other, WS, JOB, FIELD, "racer")

        assert faults.injected["/locks/acquire"] == 1
        assert result.status == "computed"
        assert provider.calls == 1
        assert not racer.acquired
        again = await compute_once(
            other, WS, JOB, FIELD, check=other_check, compute=other_compute, holder="x"
        )
        assert again == ComputeResult("present", result.value)
        assert provider.calls == 1


@pytest.mark.parametrize(
    "holder_cancelled", [False, True], ids=["holder-waits", "holder-cancelled"]
)
async def test_a_write_still_in_flight_when_the_budget_runs_out_is_not_raced_by_a_second_payer(
    aiohttp_server: ServerFactory, tmp_path: Path, open_client: OpenClient, holder_cancelled: bool
) -> None:
    # The provider answered and the write was sent, but the server is slow to commit it: the
    # holder's budget runs out and its compute is cancelled — yet a cancelled `apply_op` does
    # not unsend the op (docs/client.md). Handing the key over now would let a waiter double-check
    # before that write lands and pay for the same cell again. The key must stay locked until
    # its TTL, by when the late write is in and the waiter finds it. The same if the holder is
    # itself cancelled while it waits for that write (the drain deadline, a lost lease).
    # The holder's clock jumps after its acquisition (`stalled_after_acquiring`): its budget
    # runs out WRITE_BUDGET seconds into the compute, with the write held by the server, while
    # the lock keeps most of its 60 s TTL there.
    slow = SlowCellWrites()
    url = await slow.serve(aiohttp_server, tmp_path / "slow.db")
    holder_client = await open_client(url, config=fast_config(ops_over_websocket=False))
    waiter_client = await open_client(url)
    await seed_job(holder_client)
    provider = GatedProvider()
    provider.gate.set()
    check, compute = cell(holder_client, provider)

    cut = asyncio.Event()

    async def cut_compute() -> JsonValue:
        try:
            return await compute()
        except asyncio.CancelledError:
            cut.set()  # the budget ran out: the compute is cancelled mid-write
            raise

    worker = SkippingClock()
    holder = asyncio.create_task(
        compute_once(
            holder_client,
            WS,
            JOB,
            FIELD,
            check=stalled_after_acquiring(check, worker, budget=WRITE_BUDGET),
            compute=cut_compute,
            holder="a",
            now=worker.now,
        )
    )
    await asyncio.wait_for(slow.held.wait(), 10)  # paid, and the write is on its way
    waiter = asyncio.create_task(
        compute_or_wait(waiter_client, provider, "b", wait=10, polling=FAST_POLL)
    )
    await asyncio.wait_for(cut.wait(), 10)
    if holder_cancelled:
        holder.cancel()  # while it waits for its write
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(holder, 10)
    # The waiter's next poll. Had the key been handed over, it wins it: let it get as far as
    # its double-check and provider call before the slow write lands (the double-pay order).
    polls = slow.acquisitions.value
    await slow.acquisitions.reach(polls + 1)
    if slow.granted[polls]:
        await provider.arrived.reach(2)
    slow.let_go.set()  # the slow write commits, the holder's lock still live on the server

    if not holder_cancelled:
        with pytest.raises(LockExpiringError):
            await asyncio.wait_for(holder, 10)
    result = await asyncio.wait_for(waiter, 10)

    assert provider.calls == 1
    assert result.status == "present"
    assert await cell_writes(waiter_client) == 1


# -- single-flight followers that give up ----------------------------------------------------------


async def test_a_cancelled_single_flight_follower_leaves_the_shared_run_to_the_others() -> None:
    flight: SingleFlight[str] = SingleFlight()
    gate = asyncio.Event()
    started = asyncio.Event()
    runs = 0

    async def work() -> str:
        nonlocal runs
        runs += 1
        started.set()
        await gate.wait()
        return "answer"

    leader = asyncio.create_task(flight.run("k", work))
    await started.wait()
    quitter = asyncio.create_task(flight.run("k", work))
    stayer = asyncio.create_task(flight.run("k", work))
    await asyncio.sleep(0)  # both followers are parked on the leader's flight
    quitter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await quitter
    assert not leader.done()
    assert flight.running("k")
    gate.set()

    assert await leader == ("answer", False)
    assert await stayer == ("answer", True)
    assert runs == 1
    assert not flight.running("k")


async def test_followers_of_a_cancelled_leader_elect_one_new_leader_between_them() -> None:
    flight: SingleFlight[str] = SingleFlight()
    gate = asyncio.Event()
    started = Watched()

    async def work() -> str:
        await started.add()
        await gate.wait()
        return "answer"

    leader = asyncio.create_task(flight.run("k", work))
    await started.reach(1)
    followers = [asyncio.create_task(flight.run("k", work)) for _ in range(3)]
    await asyncio.sleep(0)
    leader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leader
    await started.reach(2)  # one follower took the lead; the gate is still shut
    for _ in range(5):
        await asyncio.sleep(0)  # let the other followers wake and pick their side
    gate.set()

    outcomes: list[tuple[Any, bool]] = await asyncio.wait_for(asyncio.gather(*followers), 5)

    assert started.value == 2  # the cancelled run and exactly one re-run, not three
    assert sorted(shared for _, shared in outcomes) == [False, True, True]
    assert {value for value, _ in outcomes} == {"answer"}
