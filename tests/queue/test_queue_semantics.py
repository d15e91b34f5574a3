"""The queue's worker-facing rules beyond the contract suites (docs/queue.md), on SQLite and on
PostgreSQL. A claim that was failed is not completed afterwards, nor the other way round; the holder
of a request parked at its last dequeue writes nothing; a rerun racing the completion (from another
connection) never forks a run; a waiter arriving after the outcome is answered at once; idle workers
are woken only by work they may claim.

Time is passed in (leases and backoffs without waiting on any clock), except for the waiters, whose
sweep is set far beyond each test's patience: what arrives in time was pushed or read."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import sqlite_utils

from cv_server import create_app
from cv_server.config import ServerConfig
from cv_server.pg import create_pool, migrate
from cv_server.pg.queue import PostgresQueueStore
from cv_server.queue import LeaseLost, ProcessRequest, QueueStore
from cv_server.sqlite import idempotency as idempotency_sqlite
from cv_server.sqlite import queue as sqlite
from cv_server.sqlite.engine import SQLiteDatabase
from cv_server.sqlite.queue import SQLiteQueueStore
from cv_server.waiters import Waiters, WorkSignals
from tests.contract.queue_contract import LEASE, OTHER_WS, STAGE, WS, request
from tests.pg.helpers import fresh_schema, settings_for
from tests.server.conftest import SECRET, auth

CONFIG = ServerConfig()
BACKOFF = CONFIG.failure_backoff_seconds
#: Far beyond any wait here: a waiter that returns in time was answered, not swept.
NO_SWEEP = 600.0
PATIENCE = 10.0
ROUNDS = 12

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def _schema(db: sqlite_utils.Database) -> None:
    sqlite.create_schema(db)
    idempotency_sqlite.create_schema(db)


@pytest.fixture(params=BACKENDS)
async def stores(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[QueueStore, QueueStore]]:
    """A store and a peer on the same database through another connection (a second server
    process on the SQLite file, a second instance on the PostgreSQL schema)."""
    if request.param == "sqlite":
        path = tmp_path / "queue.db"
        first = await SQLiteDatabase.open(path, schema=_schema)
        second = await SQLiteDatabase.open(path, schema=_schema)
        yield SQLiteQueueStore(first), SQLiteQueueStore(second)
        await second.close()
        await first.close()
        return
    postgres_url: str = request.getfixturevalue("postgres_url")
    async with fresh_schema(postgres_url) as schema:
        pools = [await create_pool(postgres_url, settings_for(schema)) for _ in range(2)]
        await migrate(pools[0])
        pair = [PostgresQueueStore(pool, channel=f"cv_queue_{schema}") for pool in pools]
        yield pair[0], pair[1]
        for store, pool in zip(pair, pools, strict=True):
            await store.close()
            await pool.close()


async def _held(store: QueueStore, now: float, lease: float = LEASE) -> ProcessRequest:
    row = await store.claim(STAGE, "w", lease, now)
    assert row is not None
    assert row.claim_token is not None
    return row


async def test_a_failed_claim_can_then_neither_complete_nor_beat_and_stays_failed(
    stores: tuple[QueueStore, QueueStore],
) -> None:
    store, peer = stores
    await store.enqueue(request(), 1.0)
    held = await _held(store, 2.0)
    token = held.claim_token or ""
    failed = await store.fail(held.request_id, token, {"code": "boom"}, BACKOFF, 3.0)
    assert (failed.status, failed.available_at) == ("pending", 3.0 + BACKOFF)
    for verb in (store, peer):
        with pytest.raises(LeaseLost):
            await verb.complete(held.request_id, token, {"late": True}, 4.0)
        with pytest.raises(LeaseLost):
            await verb.heartbeat(held.request_id, token, LEASE, 4.0)
        # The holder's retried fail is answered with the row as it stands, changing nothing.
        assert await verb.fail(held.request_id, token, {"code": "other"}, BACKOFF, 5.0) == failed
    assert await peer.get(WS, held.request_id) == failed
    assert await peer.claim(STAGE, "w", LEASE, 3.0 + BACKOFF - 0.001) is None
    again = await _held(peer, 3.0 + BACKOFF)
    assert (again.dequeue_count, again.claim_token != token) == (2, True)


async def test_a_completed_claim_can_then_neither_fail_nor_beat_and_its_result_stands(
    stores: tuple[QueueStore, QueueStore],
) -> None:
    store, peer = stores
    await store.enqueue(request(), 1.0)
    held = await _held(store, 2.0)
    token = held.claim_token or ""
    done = await store.complete(held.request_id, token, {"v": 1}, 3.0)
    for verb in (store, peer):
        with pytest.raises(LeaseLost):
            await verb.fail(held.request_id, token, {"code": "late"}, BACKOFF, 4.0)
        with pytest.raises(LeaseLost):
            await verb.heartbeat(held.request_id, token, LEASE, 4.0)
        assert await verb.complete(held.request_id, token, {"v": 2}, 5.0) == done
    assert await peer.get(WS, held.request_id) == done
    assert await peer.claim(STAGE, "w", LEASE, 3.0 + 10 * LEASE) is None


async def test_the_holder_of_a_request_parked_at_its_last_dequeue_cannot_finish_it(
    stores: tuple[QueueStore, QueueStore],
) -> None:
    """A waiter was told "poison" when the row was parked: no later write may change that."""
    store, peer = stores
    await store.enqueue(request(max_dequeues=2), 0.0)
    first = await _held(store, 1.0)
    second = await _held(peer, 1.0 + LEASE + 1)  # the first holder's lease lapsed
    assert second.dequeue_count == 2
    lapsed = 1.0 + LEASE + 1 + LEASE + 1
    assert await store.claim(STAGE, "w", LEASE, lapsed) is None  # parked, not handed out
    parked = await peer.get(WS, second.request_id)
    assert parked is not None
    assert (parked.status, parked.error["code"]) == ("poison", "lease_lapsed")
    for holder in (first, second):
        token = holder.claim_token or ""
        with pytest.raises(LeaseLost):
            await store.complete(holder.request_id, token, {"late": True}, lapsed + 1)
        with pytest.raises(LeaseLost):
            await peer.heartbeat(holder.request_id, token, LEASE, lapsed + 1)
    # The last holder's fail is answered with the outcome as it stands: the poison stays.
    after = await peer.fail(second.request_id, second.claim_token or "", {"e": 1}, 0.0, lapsed)
    assert after == parked
    assert await store.get(WS, second.request_id) == parked


async def test_a_rerun_racing_the_completion_on_another_connection_never_forks_a_run(
    stores: tuple[QueueStore, QueueStore],
) -> None:
    store, peer = stores
    now = 1.0
    await store.enqueue(request(input={"v": 0}), now)
    for attempt in range(1, ROUNDS + 1):
        now += 1.0
        held = await _held(store, now)
        assert held.run == attempt
        done, (row, coalesced) = await asyncio.gather(
            store.complete(held.request_id, held.claim_token or "", {"run": attempt}, now),
            peer.enqueue(request(input={"v": attempt}), now, rerun=True),
        )
        assert (done.status, done.run, done.result) == ("done", attempt, {"run": attempt})
        if coalesced:  # absorbed by the run in flight, whose answer stands
            assert row.run == attempt
            await peer.enqueue(request(input={"v": attempt}), now, rerun=True)
        else:  # re-opened after the completion: one new run, with the new input
            assert (row.status, row.run, row.input) == ("pending", attempt + 1, {"v": attempt})
        current = await store.get(WS, held.request_id)
        assert current is not None
        assert (current.status, current.run) == ("pending", attempt + 1)
        assert current.dequeue_count == 0


async def test_a_waiter_arriving_after_the_outcome_is_answered_at_once(
    stores: tuple[QueueStore, QueueStore],
) -> None:
    store, peer = stores
    waiters = Waiters(store, sweep_seconds=NO_SWEEP)
    waiters.start()
    try:
        done_id = (await peer.enqueue(request("done"), 1.0)).row.request_id
        held = await _held(peer, 2.0)
        await peer.complete(held.request_id, held.claim_token or "", {"ok": 1}, 3.0)
        poison_id = (await peer.enqueue(request("poison", max_dequeues=1), 1.0)).row.request_id
        held = await _held(peer, 4.0)
        await peer.fail(held.request_id, held.claim_token or "", {"code": "x"}, BACKOFF, 5.0)
        async with asyncio.timeout(PATIENCE / 2):
            done = await waiters.wait(WS, done_id, NO_SWEEP)
            poison = await waiters.wait(WS, poison_id, NO_SWEEP)
        assert done is not None
        assert poison is not None
        assert (done.status, done.result, poison.status) == ("done", {"ok": 1}, "poison")
        assert waiters.count == 0
    finally:
        await waiters.close()


async def test_idle_workers_are_woken_only_by_work_they_may_claim(
    stores: tuple[QueueStore, QueueStore],
) -> None:
    store, _ = stores
    signals = WorkSignals(store)
    try:
        mine = frozenset({STAGE})
        sleepers = {
            "all": asyncio.create_task(signals.wait(mine, None, PATIENCE)),
            "ws": asyncio.create_task(signals.wait(mine, frozenset({WS}), PATIENCE)),
            "other_ws": asyncio.create_task(signals.wait(mine, frozenset({OTHER_WS}), 0.5)),
            "other_class": asyncio.create_task(signals.wait(frozenset({"other"}), None, 0.5)),
        }
        await asyncio.sleep(0)  # every sleeper registered
        await store.enqueue(request(ws=WS), 1.0)
        woken = {name: await task for name, task in sleepers.items()}
        assert woken == {"all": True, "ws": True, "other_ws": False, "other_class": False}
        # Work that fails is pending again: the sleepers of its class hear of it.
        held = await _held(store, 2.0)
        sleeper = asyncio.create_task(signals.wait(mine, frozenset({WS}), PATIENCE))
        await asyncio.sleep(0)
        await store.fail(held.request_id, held.claim_token or "", None, 0.0, 3.0)
        assert await sleeper
    finally:
        signals.close()


async def test_an_idle_worker_looks_again_when_a_concurrency_key_frees_a_slot(
    stores: tuple[QueueStore, QueueStore],
) -> None:
    """Requests a full key holds back are not claimable, so an idle worker waits; when the
    key's running request finishes, the wait looks again and finds them, long before its
    patience runs out. A sleeper of another workspace is not woken."""
    store, _ = stores
    signals = WorkSignals(store)
    try:
        for job, at in (("a0", 1.0), ("a1", 2.0)):
            keyed = dataclasses.replace(
                request(job, ws=WS), concurrency_key="k", max_running_per_key=1
            )
            await store.enqueue(keyed, at)
        running = await _held(store, 3.0)
        looked = asyncio.Event()

        async def pending_now() -> bool:
            found = await store.has_claimable(STAGE, 4.0, workspace_ids=[WS])
            looked.set()
            return found

        mine = frozenset({STAGE})
        sleeper = asyncio.create_task(
            signals.wait(mine, frozenset({WS}), PATIENCE, pending_now=pending_now)
        )
        elsewhere = asyncio.create_task(signals.wait(mine, frozenset({OTHER_WS}), 0.5))
        await asyncio.wait_for(looked.wait(), PATIENCE)  # it looked, found nothing, and waits
        assert not sleeper.done()
        await store.complete(running.request_id, running.claim_token or "", None, 4.0)
        assert await asyncio.wait_for(sleeper, PATIENCE)
        assert not await elsewhere
    finally:
        signals.close()


async def test_work_pending_before_a_worker_waits_is_found_and_none_slips_between(
    stores: tuple[QueueStore, QueueStore],
) -> None:
    """`pending_now` answers a wait at once; and it is asked only once the wait listens, so work
    that became pending after the look found none still wakes the wait (the look here is made
    to find nothing: only the push can answer before the patience runs out)."""
    store, _ = stores
    signals = WorkSignals(store)
    try:
        mine = frozenset({STAGE})

        async def already() -> bool:
            return True

        assert await asyncio.wait_for(signals.wait(mine, None, PATIENCE, pending_now=already), 1)

        async def enqueue_after_looking() -> bool:
            await store.enqueue(request(ws=WS), 1.0)
            return False

        woken = signals.wait(mine, frozenset({WS}), PATIENCE, pending_now=enqueue_after_looking)
        assert await woken
    finally:
        signals.close()


# -- through HTTP ----------------------------------------------------------------------------------

#: JSON text, but past 64 bits: `decode_json` keeps it exact, and no store answer can carry it back.
BIG = 123456789012345678901234567890


async def test_a_payload_with_an_integer_past_64_bits_is_refused_for_what_it_is(
    aiohttp_client: Any, tmp_path: Path
) -> None:
    """It was refused with "input is nested too deeply": the client looked for a nesting it never
    sent. The answer now names the integer (the code stays `invalid_field`)."""
    client = await aiohttp_client(
        create_app(ServerConfig(db_path=tmp_path / "cv.db", token_secret=SECRET))
    )
    headers = {**auth(WS), "Content-Type": "application/json"}
    requests = f"/v1/workspaces/{WS}/requests"
    resp = await client.post(
        requests, data=f'{{"stage": "{STAGE}", "input": {BIG}}}', headers=headers
    )
    problem = await resp.json()
    assert (resp.status, problem["code"]) == (422, "invalid_field")
    assert "64" in problem["detail"]
    assert "nested" not in problem["detail"]
    resp = await client.post(requests, json={"stage": STAGE}, headers=auth(WS))
    request_id = (await resp.json())["request_id"]
    resp = await client.post("/v1/queue/claim", json={"worker_classes": [STAGE]}, headers=auth(WS))
    token = (await resp.json())["request"]["claim_token"]
    # (Telemetry past 64 bits is dropped instead, never refused: it is fire-and-forget,
    # tests/observe/test_metrics_workload.py.)
    for verb, member in (("complete", "result"), ("fail", "error")):
        text = f'{{"claim_token": "{token}", "{member}": [{BIG}]}}'
        resp = await client.post(f"{requests}/{request_id}/{verb}", data=text, headers=headers)
        problem = await resp.json()
        assert (resp.status, problem["code"]) == (422, "invalid_field"), (verb, member)
        assert member in problem["detail"]
        assert "64" in problem["detail"]
        assert "nested" not in problem["detail"]
