"""`compute_once` against the real server: the five steps, the waiting, the lock's bounds."""

from __future__ import annotations

import asyncio
import time

import pytest
from pydantic import JsonValue

from cv_mutations import NodeUpdate
from cv_workspace_client.compute import (
    LOCK_MARGIN_FRACTION,
    ComputeResult,
    LockExpiringError,
    LockPolling,
    acquire_lock,
    compute_budget,
    compute_once,
    release_lock,
)
from cv_workspace_client.stage import LeaseLostError
from cv_workspace_client.testing import FaultProxy
from tests.clocks import SkippingClock

from .conftest import OpenClient
from .helpers import (
    FIELD,
    JOB,
    JOBS,
    LOCK_TTL,
    WS,
    GatedProvider,
    RequestLog,
    cell,
    compute_or_wait,
    seed_job,
    stalled_after_acquiring,
    timed,
)

FAST_POLL = LockPolling(initial_seconds=0.02, max_seconds=0.2)
NO_POLL = LockPolling(initial_seconds=3600, max_seconds=3600)


async def done_count(tasks: list[asyncio.Task[ComputeResult[JsonValue]]], n: int) -> None:
    """Wait (bounded) until `n` of the tasks have finished."""
    async with asyncio.timeout(10):
        while sum(task.done() for task in tasks) < n:
            await asyncio.wait(
                [t for t in tasks if not t.done()], return_when=asyncio.FIRST_COMPLETED
            )


async def test_a_value_already_there_returns_present_without_touching_the_lock(
    server_url: str, open_client: OpenClient, request_log: RequestLog
) -> None:
    client = await open_client(server_url)
    await seed_job(client, **{FIELD: "known"})
    provider = GatedProvider()
    check, compute = cell(client, provider)

    result = await compute_once(client, WS, JOB, FIELD, check=check, compute=compute, holder="w1")

    assert result == ComputeResult("present", "known")
    assert provider.calls == 0
    assert request_log.count("/locks/acquire") == 0
    assert request_log.count("/locks/release") == 0


async def test_concurrent_callers_compute_once_and_the_others_are_told_locked(
    server_url: str, open_client: OpenClient, request_log: RequestLog
) -> None:
    clients = [await open_client(server_url) for _ in range(5)]
    await seed_job(clients[0])
    provider = GatedProvider()
    tasks = []
    for i, client in enumerate(clients):
        check, compute = cell(client, provider)
        run = compute_once(client, WS, JOB, FIELD, check=check, compute=compute, holder=f"w{i}")
        tasks.append(asyncio.create_task(run))

    # The holder is inside its provider call (gate shut) while every other caller got its
    # answer: those four must come back without waiting for it.
    await provider.arrived.reach(1)
    await done_count(tasks, 4)
    assert provider.calls == 1
    provider.gate.set()
    results = await asyncio.gather(*tasks)

    assert sorted(r.status for r in results) == ["computed", "locked", "locked", "locked", "locked"]
    assert provider.calls == 1
    assert request_log.count("/locks/acquire") == 5
    assert request_log.count("/locks/release") == 1


async def test_locked_callers_that_wait_get_the_value_from_the_broadcast(
    server_url: str, open_client: OpenClient, request_log: RequestLog
) -> None:
    clients = [await open_client(server_url) for _ in range(5)]
    await seed_job(clients[0])
    provider = GatedProvider()
    tasks = []
    for i, client in enumerate(clients):
        # NO_POLL: no second acquisition, only the broadcast can end the wait.
        run = compute_or_wait(client, provider, f"w{i}", wait=10, polling=NO_POLL)
        tasks.append(asyncio.create_task(run))
    await provider.arrived.reach(1)
    async with asyncio.timeout(10):
        while request_log.count("/locks/acquire") < 5:
            await request_log.answered.reach(len(request_log.entries) + 1)
    assert not any(task.done() for task in tasks)  # the locked ones are waiting
    provider.gate.set()
    results = await asyncio.gather(*tasks)

    statuses = sorted(r.status for r in results)
    assert statuses == ["computed", "present", "present", "present", "present"]
    assert len({r.value for r in results}) == 1
    assert provider.calls == 1
    assert request_log.count("/locks/acquire") == 5  # nobody asked twice: the broadcast did it


async def test_a_write_landing_between_the_preflight_and_the_lock_is_caught_by_the_double_check(
    server_url: str, open_client: OpenClient, request_log: RequestLog
) -> None:
    client = await open_client(server_url)
    await seed_job(client)
    provider = GatedProvider()
    read, compute = cell(client, provider)
    checks = 0

    async def check() -> JsonValue | None:
        nonlocal checks
        checks += 1
        value = await read()
        if checks == 1:  # another holder writes and releases right after our pre-flight
            await client.apply_op(WS, JOBS, NodeUpdate(node_id=JOB, set={FIELD: "theirs"}))
        return value

    result = await compute_once(client, WS, JOB, FIELD, check=check, compute=compute, holder="w")

    assert result == ComputeResult("present", "theirs")
    assert checks == 2
    assert provider.calls == 0
    assert request_log.count("/locks/release") == 1  # found inside the lock: released


async def test_a_crashed_holder_blocks_the_key_for_at_most_one_ttl(
    server_url: str, open_client: OpenClient, request_log: RequestLog, lock_clock: SkippingClock
) -> None:
    client = await open_client(server_url)
    await seed_job(client)
    crashed = await acquire_lock(client, WS, JOB, FIELD, "crashed-worker")  # never released
    assert crashed.acquired
    provider = GatedProvider()
    provider.gate.set()
    _, compute = cell(client, provider)
    started: list[float] = []
    waiter = asyncio.create_task(
        compute_or_wait(
            client, provider, "w", wait=LOCK_TTL, polling=FAST_POLL, compute=timed(compute, started)
        )
    )
    await request_log.wait_locked(JOB, FIELD)
    lapsed_at = time.time()
    lock_clock.skip(LOCK_TTL)  # the crashed holder's lock lapses, with the waiter waiting

    async with asyncio.timeout(10):  # a poll away, not at the end of its wait (one more TTL)
        result = await waiter

    assert result.status == "computed"
    assert provider.calls == 1
    assert started[0] >= lapsed_at  # not before the crashed holder's lock lapsed


async def test_a_waiter_takes_over_when_the_holder_gives_up_without_writing(
    server_url: str, open_client: OpenClient, request_log: RequestLog
) -> None:
    clients = [await open_client(server_url) for _ in range(2)]
    await seed_job(clients[0])
    provider = GatedProvider()
    check, _ = cell(clients[0], provider)

    async def failing() -> JsonValue:
        await provider.complete("doomed")  # paid for, then the holder's stage gives up
        raise RuntimeError("provider answer unusable")

    holder = asyncio.create_task(
        compute_once(clients[0], WS, JOB, FIELD, check=check, compute=failing, holder="a")
    )
    await provider.arrived.reach(1)
    waiter = asyncio.create_task(
        compute_or_wait(clients[1], provider, "b", wait=10, polling=FAST_POLL)
    )
    await request_log.wait_locked(JOB, FIELD)
    provider.gate.set()

    with pytest.raises(RuntimeError, match="unusable"):
        await holder
    result = await waiter

    # No write was ever broadcast: the waiter's poll found the released lock and took it.
    assert result.status == "computed"
    assert provider.calls == 2
    assert request_log.count("/locks/release") == 2


async def test_a_waiting_caller_gives_up_as_locked_at_its_deadline(
    server_url: str, open_client: OpenClient
) -> None:
    client = await open_client(server_url)
    await seed_job(client)
    holder = await acquire_lock(client, WS, JOB, FIELD, "busy-worker")
    provider = GatedProvider()
    check, compute = cell(client, provider)
    loop = asyncio.get_running_loop()
    began = loop.time()

    result = await compute_once(
        client, WS, JOB, FIELD, check=check, compute=compute, holder="w", sub_doc=JOBS, wait=0.3
    )

    assert result == ComputeResult("locked", None)
    assert 0.3 <= loop.time() - began < LOCK_TTL / 2  # at its deadline, not at the lock's lapse
    assert provider.calls == 0
    assert holder.token is not None
    assert await release_lock(client, WS, JOB, FIELD, holder.token)


async def test_only_the_holder_releases_its_lock(
    server_url: str, open_client: OpenClient, lock_clock: SkippingClock
) -> None:
    client = await open_client(server_url)
    first = await acquire_lock(client, WS, JOB, FIELD, "a")
    assert first.acquired
    assert first.token is not None
    assert not await release_lock(client, WS, JOB, FIELD, "not-the-token")
    assert not (await acquire_lock(client, WS, JOB, FIELD, "c")).acquired

    # `a` outlives its TTL; `b` takes the key over; `a`'s late release must not free `b`'s lock.
    lock_clock.skip(LOCK_TTL)
    second = await acquire_lock(client, WS, JOB, FIELD, "b")
    assert second.acquired
    assert not await release_lock(client, WS, JOB, FIELD, first.token)
    assert not (await acquire_lock(client, WS, JOB, FIELD, "c")).acquired
    assert second.token is not None
    assert await release_lock(client, WS, JOB, FIELD, second.token)
    assert (await acquire_lock(client, WS, JOB, FIELD, "c")).acquired


async def test_a_compute_that_outruns_its_lock_is_cancelled_before_the_lock_lapses(
    server_url: str, open_client: OpenClient
) -> None:
    client = await open_client(server_url)
    await seed_job(client)
    provider = GatedProvider()  # the gate never opens: a provider that hangs
    check, compute = cell(client, provider)
    cancelled = asyncio.Event()
    cancelled_at: list[float] = []
    # The worker's clock jumps between the acquisition and the compute (a paused process): most
    # of the budget is gone before the call starts, and the rest runs out during it.
    worker = SkippingClock()

    async def hanging() -> JsonValue:
        try:
            return await compute()
        except asyncio.CancelledError:
            cancelled_at.append(worker.now())
            cancelled.set()
            raise

    asked = worker.now()
    with pytest.raises(LockExpiringError) as raised:
        await compute_once(
            client,
            WS,
            JOB,
            FIELD,
            check=stalled_after_acquiring(check, worker),
            compute=hanging,
            holder="w",
            now=worker.now,
        )

    assert raised.value.code == "compute_lock_expiring"
    assert cancelled.is_set()
    # Cancelled with the margin (a tenth of the TTL, 6 s) still ahead, on the worker's clock:
    # before the lock could lapse. (The moment of the cancel, not of the return: the release's
    # round trip comes after it.)
    assert cancelled_at[0] < asked + LOCK_TTL
    # And released: the lock has most of its TTL left on the server, so only the holder's
    # release can free the key.
    assert (await acquire_lock(client, WS, JOB, FIELD, "next")).acquired


async def test_a_lost_queue_lease_stops_the_compute_before_it_pays(
    server_url: str, open_client: OpenClient, request_log: RequestLog
) -> None:
    client = await open_client(server_url)
    await seed_job(client)
    provider = GatedProvider()
    check, compute = cell(client, provider)

    def lease() -> None:
        raise LeaseLostError()

    with pytest.raises(LeaseLostError):
        await compute_once(
            client, WS, JOB, FIELD, check=check, compute=compute, holder="w", lease=lease
        )

    assert provider.calls == 0
    assert request_log.count("/locks/acquire") == 0


async def test_a_failing_compute_releases_the_lock_and_raises(
    server_url: str, open_client: OpenClient
) -> None:
    client = await open_client(server_url)
    await seed_job(client)
    provider = GatedProvider()
    check, _ = cell(client, provider)

    async def failing() -> JsonValue:
        raise RuntimeError("provider exploded")

    with pytest.raises(RuntimeError, match="provider exploded"):
        await compute_once(client, WS, JOB, FIELD, check=check, compute=failing, holder="w")

    assert (await acquire_lock(client, WS, JOB, FIELD, "next")).acquired


async def test_a_lost_acquire_answer_is_recognised_on_the_retry_and_computed_once(
    server_url: str, open_client: OpenClient, request_log: RequestLog
) -> None:
    async with FaultProxy(server_url) as proxy:
        client = await open_client(proxy.url)
        provider = GatedProvider()
        provider.gate.set()
        computes = 0

        async def check() -> JsonValue | None:
            return None  # no HTTP: the acquisition is the first request through the proxy

        async def compute() -> JsonValue:
            nonlocal computes
            computes += 1
            return (await provider.complete("p")).text

        proxy.cut_next(1)  # the server takes the lock; its answer never arrives
        result = await compute_once(
            client, WS, JOB, FIELD, check=check, compute=compute, holder="w"
        )

        assert proxy.stats.cuts == 1
    assert result.status == "computed"
    assert computes == 1
    assert request_log.count("/locks/acquire") == 2
    # The token was lost with the answer: the lock is ours until it lapses, nobody else's.
    assert request_log.count("/locks/release") == 0
    other = await open_client(server_url)
    assert not (await acquire_lock(other, WS, JOB, FIELD, "other")).acquired


async def test_waiting_needs_the_sub_doc_the_value_is_written_to(
    server_url: str, open_client: OpenClient
) -> None:
    client = await open_client(server_url)
    provider = GatedProvider()
    check, compute = cell(client, provider)
    with pytest.raises(ValueError, match="sub_doc"):
        await compute_once(client, WS, JOB, FIELD, check=check, compute=compute, holder="w", wait=1)


def test_the_compute_budget_keeps_a_margin_of_the_lock_lifetime_free() -> None:
    assert compute_budget(100.0, 160.0, 100.0) == pytest.approx(60.0 * (1 - LOCK_MARGIN_FRACTION))
    assert compute_budget(100.0, 160.0, 130.0) == pytest.approx(30.0 - 60.0 * LOCK_MARGIN_FRACTION)
    assert compute_budget(100.0, 160.0, 159.0) < 0


def test_lock_polling_doubles_up_to_its_ceiling() -> None:
    polling = LockPolling()
    assert [polling.delay(n) for n in range(7)] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
