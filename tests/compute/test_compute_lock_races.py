"""The compute lock (layer 2, docs/stages.md) never pays an expensive call twice, nor leaves a
waiter without its value, under races: a holder whose write failed but is still on its way,
provider errors, key strings at their edges, two instances on one PostgreSQL database, a result
cache that evicted its entry. Builds on `helpers.py` and on what
`test_compute_lock_concurrency.py` already covers."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest
from aiohttp.test_utils import TestServer
from pydantic import JsonValue

from cv_mutations import NodeInsert
from cv_server import ServerConfig, create_app
from cv_server.keys import STORES
from cv_workspace_client._queue import requester as queue_api
from cv_workspace_client.compute import ComputeResult, LockPolling, acquire_lock, compute_once
from cv_workspace_client.errors import InvalidRequestError, StillPendingError
from cv_workspace_client.providers import ProviderResult, ProviderUnavailable, fake_answer
from cv_workspace_client.stage import Stage
from cv_workspace_client.stages import make_evaluate
from cv_workspace_client.worker import Worker, WorkerConfig
from tests.clocks import SkippingClock

from .conftest import OpenClient, ServerFactory, StartServer
from .helpers import (
    FIELD,
    JOB,
    JOBS,
    LOCK_TTL,
    SECRET,
    WS,
    GatedProvider,
    RequestLog,
    cell,
    cell_writes,
    compute_or_wait,
    eval_writes,
    fast_config,
    holder_process,
    seed_job,
    timed,
)
from .test_compute_edges import Faults
from .test_compute_lock_concurrency import backend as backend
from .test_compute_lock_concurrency import pg_dsn as pg_dsn

FAST_POLL = LockPolling(initial_seconds=0.02, max_seconds=0.1)


@pytest.fixture
def start_any(backend: dict[str, Any], aiohttp_server: ServerFactory) -> StartServer:
    """`await start_any(*middlewares, **config)` → a fresh server on SQLite or PostgreSQL (the
    `backend` of `test_compute_lock_concurrency.py`, which stops the servers before dropping its
    schema)."""

    async def start(*middlewares: Any, **overrides: Any) -> str:
        app = create_app(ServerConfig(**{"token_secret": SECRET, **backend, **overrides}))
        app.middlewares[0:0] = middlewares
        server: TestServer = await aiohttp_server(app)
        return str(server.make_url("")).rstrip("/")

    return start


async def serve(
    aiohttp_server: ServerFactory, db_path: Path, *middlewares: Any, **config: Any
) -> str:
    """A real server on SQLite at `db_path` with `middlewares` (outermost first); its URL."""
    app = create_app(ServerConfig(db_path=db_path, token_secret=SECRET, **config))
    app.middlewares[0:0] = middlewares
    server: TestServer = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


# -- a holder whose write gave up but is still on its way ------------------------------------------


async def test_a_holder_whose_write_gave_up_keeps_the_key_until_the_write_lands(
    aiohttp_server: ServerFactory, tmp_path: Path, open_client: OpenClient
) -> None:
    # The holder paid; its write got no answer after the client's last retry: `apply_op` raises
    # `StillPendingError`, and the op waits in the outbox to be replayed (it is not lost,
    # docs/client.md). Had the key been released with the compute's error, a waiter would take it
    # over, double-check before the replay lands, pay for the same call again and write the cell a
    # second time once the replay comes in.
    faults, log = Faults(), RequestLog()
    url = await serve(aiohttp_server, tmp_path / "cv.db", log.middleware, faults.middleware)
    holder_client = await open_client(url, config=fast_config(ops_over_websocket=False))
    waiter_client = await open_client(url)
    await seed_job(holder_client)
    provider = GatedProvider()
    check, compute = cell(holder_client, provider)
    holder = asyncio.create_task(
        compute_once(holder_client, WS, JOB, FIELD, check=check, compute=compute, holder="a")
    )
    await provider.arrived.reach(1)  # the holder is paying
    waiter = asyncio.create_task(
        compute_or_wait(waiter_client, provider, "b", wait=15, polling=FAST_POLL)
    )
    await log.wait_locked(JOB, FIELD)
    # Every attempt of the holder's write is refused before it reaches the log.
    faults.fail("/docs/jobs/ops", 503, holder_client.config.retry_attempts, after=False)
    provider.gate.set()

    with pytest.raises(StillPendingError):
        await asyncio.wait_for(holder, 15)
    result = await asyncio.wait_for(waiter, 15)
    await asyncio.wait_for(holder_client.wait_synced(), 10)  # the replay, if still pending

    assert provider.calls == 1
    assert result.status == "present"
    assert await cell_writes(waiter_client) == 1


# -- two callers going by the same holder name -----------------------------------------------------


async def test_a_second_caller_with_the_same_holder_name_is_told_locked(
    server_url: str, open_client: OpenClient
) -> None:
    # `acquire_lock` takes "locked by `holder`" for its own lost answer — right only on a retry
    # of the same call. Two stages of one worker that both name the worker id as holder would
    # otherwise both be told `acquired`, and both pay for the call.
    first_client, second_client = [await open_client(server_url) for _ in range(2)]
    first, second = await asyncio.gather(
        acquire_lock(first_client, WS, JOB, FIELD, "worker-1"),
        acquire_lock(second_client, WS, JOB, FIELD, "worker-1"),
    )

    assert sorted([first.acquired, second.acquired]) == [False, True]
    loser = second if first.acquired else first
    assert loser.holder == "worker-1"
    assert loser.token is None


# -- the provider failing: the next racer retries, one at a time ----------------------------------


class FailingFirst:
    """A provider whose first `failures` calls fail (after every racer is waiting: `go`), and
    whose later ones answer; it counts calls and the most ever in flight together."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.arrived = asyncio.Event()
        self.go = asyncio.Event()

    async def complete(
        self, prompt: str, *, model: str | None = None, **params: Any
    ) -> ProviderResult:
        self.calls += 1
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            self.arrived.set()
            await self.go.wait()
            if self.calls <= self.failures:
                raise ProviderUnavailable("upstream 503", status=503, attempts=5)
            return ProviderResult(text=fake_answer(prompt), raw={})
        finally:
            self.in_flight -= 1


@pytest.mark.parametrize("failures", [1, 3])
async def test_a_failing_provider_is_retried_by_one_racer_at_a_time(
    start_any: StartServer, open_client: OpenClient, failures: int
) -> None:
    log = RequestLog()
    url = await start_any(log.middleware)
    clients = [await open_client(url) for _ in range(2)]
    await seed_job(clients[0])
    provider = FailingFirst(failures)
    racers = [
        asyncio.create_task(
            compute_or_wait(clients[i % 2], provider, f"w{i}", wait=20, polling=FAST_POLL)
        )
        for i in range(8)
    ]
    await asyncio.wait_for(provider.arrived.wait(), 10)
    await log.wait_for(lambda log: len(log.locked) >= 7)  # everyone else is waiting
    provider.go.set()

    outcomes = await asyncio.wait_for(asyncio.gather(*racers, return_exceptions=True), 25)

    failed = [o for o in outcomes if isinstance(o, ProviderUnavailable)]
    results = [o for o in outcomes if isinstance(o, ComputeResult)]
    assert len(failed) == failures  # each failure was one racer's own call, its error raised
    assert provider.calls == failures + 1  # each failure retried by exactly one racer
    assert provider.peak_in_flight == 1  # never two at once
    assert sorted(r.status for r in results) == ["computed"] + ["present"] * (7 - failures)
    assert {r.value for r in results} == {fake_answer(f"{JOB}/{FIELD}")}
    assert await cell_writes(clients[0]) == 1


# -- key strings at their edges --------------------------------------------------------------------

LONG_JOB = "ジ" * 256  # 256 characters, 768 bytes of UTF-8
LONG_TASK = "eval:" + "🧮" * 251  # 256 characters, 1,009 bytes: the index key stays in bounds


async def test_racers_on_a_long_unicode_key_pay_once_and_similar_keys_stay_apart(
    start_any: StartServer, open_client: OpenClient
) -> None:
    url = await start_any()
    clients = [await open_client(url) for _ in range(2)]
    await seed_job(clients[0])
    provider = GatedProvider()

    async def racer(i: int) -> ComputeResult[JsonValue]:
        check, compute = cell(clients[i % 2], provider)
        return await compute_once(
            clients[i % 2],
            WS,
            LONG_JOB,
            LONG_TASK,
            check=check,
            compute=compute,
            holder="ホルダー" * 100,  # cut to 200 characters + its suffix: still within 256
            sub_doc=JOBS,
            wait=15,
            polling=FAST_POLL,
        )

    racers = [asyncio.create_task(racer(i)) for i in range(8)]
    await provider.arrived.reach(1)
    provider.gate.set()
    results = await asyncio.wait_for(asyncio.gather(*racers), 20)

    assert provider.calls == 1
    assert sorted(r.status for r in results) == ["computed"] + ["present"] * 7
    # Keys are compared as exact strings: normalisation forms, case and spacing never merge two.
    similar = ["caf\u00e9", "cafe\u0301", "Caf\u00e9", "caf\u00e9 ", LONG_TASK[:-1]]
    answers = [await acquire_lock(clients[0], WS, LONG_JOB, task, "x") for task in similar]
    assert all(answer.acquired for answer in answers)
    for task in ("", LONG_TASK + "x", "a\x00b"):
        with pytest.raises(InvalidRequestError) as refused:
            await acquire_lock(clients[0], WS, LONG_JOB, task, "x")
        assert refused.value.code == "invalid_field"


# -- two instances on one PostgreSQL database ------------------------------------------------------


@pytest.mark.postgres
async def test_a_sigkilled_holder_on_one_instance_is_taken_over_once_by_waiters_on_two(
    pg_dsn: str,
    aiohttp_server: ServerFactory,
    open_client: OpenClient,
    lock_clock: SkippingClock,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    log = RequestLog()
    urls = []
    for _ in range(2):  # the real 60 s TTL, on the database's clock as the test skips it
        app = create_app(ServerConfig(token_secret=SECRET, database_url=pg_dsn))
        app.middlewares.insert(0, log.middleware)
        server: TestServer = await aiohttp_server(app)
        lock_clock.drive(app[STORES].locks, monkeypatch)
        urls.append(str(server.make_url("")).rstrip("/"))
    clients = [await open_client(urls[i % 2]) for i in range(4)]
    await seed_job(clients[0])
    async with holder_process(urls[0], tmp_path) as proc:
        assert proc.stdout is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() == b"calling"
    provider = GatedProvider()
    provider.gate.set()
    waiters = [
        asyncio.create_task(
            compute_or_wait(clients[i % 4], provider, f"w{i}", wait=LOCK_TTL, polling=FAST_POLL)
        )
        for i in range(12)
    ]
    await log.wait_for(lambda log: len(log.locked) >= 12)  # the waiters are waiting
    lock_clock.skip(LOCK_TTL)  # the dead holder's lock lapses now, on both instances

    results = await asyncio.wait_for(asyncio.gather(*waiters), 25)

    assert provider.calls == 1  # the dead holder's call was paid; the survivors' once more
    assert sorted(r.status for r in results) == ["computed"] + ["present"] * 11
    assert await cell_writes(clients[1]) == 1


# -- the result cache evicted the answer: racers re-run the stage, and pay nothing ----------------


async def test_racers_after_the_result_cache_evicted_the_answer_find_the_cells_and_pay_nothing(
    server_url: str, open_client: OpenClient
) -> None:
    enqueuer, first_client, second_client = [await open_client(server_url) for _ in range(3)]
    for job in ("J1", "J2", "J3"):
        await enqueuer.apply_op(WS, JOBS, NodeInsert(node_id=job, parent_id="root"))
    provider = GatedProvider()
    provider.gate.set()
    stages = {"evaluate": Stage(make_evaluate(), ttl=300)}
    # A cache of two entries (the default is 500): two other jobs evict the first one's answer.
    config = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05, cache_entries=2)
    first = Worker(first_client, stages, worker_id="w1", provider=provider, config=config)
    second = Worker(second_client, stages, worker_id="w2", provider=provider, config=config)
    running = [asyncio.create_task(first.run())]
    body = {"stage": "evaluate", "input": {"columns": ["fit"]}, "deterministic": False}

    async def evaluate(job: str, key: str) -> Any:
        request = await queue_api.enqueue(
            enqueuer, WS, {**body, "job_id": job}, idempotency_key=key
        )
        return (await queue_api.wait_request(enqueuer, WS, request.request_id, timeout=20)).result

    try:
        for job in ("J1", "J2", "J3"):
            await evaluate(job, f"fill-{job}")
        assert provider.calls == 3
        running.append(asyncio.create_task(second.run()))
        again = await asyncio.wait_for(
            asyncio.gather(*(evaluate("J1", f"again-{i}") for i in range(4))), 25
        )
    finally:
        for worker in (first, second):
            worker.stop()
        await asyncio.wait_for(asyncio.gather(*running), 30)

    assert provider.calls == 3  # the re-runs found the cell: nobody paid again
    # Not the first run's cached answer (that one says it computed `fit`): the stage re-ran.
    assert all(result["computed"] == [] for result in again)
    assert len({json.dumps(result["values"]) for result in again}) == 1
    assert [job for job, _ in await eval_writes(enqueuer)].count("J1") == 1


# -- other keys never wait on a busy one -----------------------------------------------------------


@pytest.mark.postgres
async def test_a_key_whose_row_is_busy_blocks_no_other_key_nor_the_sweep(
    pg_dsn: str, aiohttp_server: ServerFactory, open_client: OpenClient
) -> None:
    # A dead lock whose row another transaction holds (an acquirer mid-takeover on another
    # instance): every other acquisition's sweep would delete it, and must skip it instead of
    # queueing behind that transaction — keys and workspaces never wait on each other.
    app = create_app(ServerConfig(token_secret=SECRET, database_url=pg_dsn))
    server: TestServer = await aiohttp_server(app)
    client = await open_client(str(server.make_url("")).rstrip("/"), WS, "ws2")
    busy = await asyncpg.connect(pg_dsn)  # the DSN's search_path: the test's schema
    try:
        await client.get_state(WS, JOBS)  # the server is up: its schema is migrated
        await busy.execute(
            "INSERT INTO compute_locks VALUES ($1, 'j', 't', 'dead', 'tok', 0, 1)", WS
        )
        async with busy.transaction():
            await busy.execute("SELECT 1 FROM compute_locks WHERE job_id = 'j' FOR UPDATE")
            # Blocked behind the busy row, they would wait for this transaction, which ends only
            # after the wait: the bound is a hang detector, far from the milliseconds they take.
            answers = await asyncio.wait_for(
                asyncio.gather(
                    *(acquire_lock(client, WS, "j", f"other-{i}", "w") for i in range(10)),
                    acquire_lock(client, "ws2", "j", "t", "w"),
                ),
                30,
            )
        assert all(answer.acquired for answer in answers)
    finally:
        await busy.close()


# -- a waiter's last chance: the lock lapsed between its last poll and its deadline ---------------


async def test_a_dead_holders_lock_lapsing_after_the_last_poll_is_taken_over_at_the_deadline(
    server_url: str, open_client: OpenClient, lock_clock: SkippingClock
) -> None:
    # Racers arrive within milliseconds of the holder; the stages wait one TTL (60 s,
    # `LOCK_WAIT_SECONDS`) so that a dead holder's lock lapses inside the wait. But polls come
    # every 2 s at most: the lock lapses after the last one, and a waiter that gives up at its
    # deadline without asking again fails `compute_locked` and waits out the queue's backoff
    # for a key that was free. Here the waiter's next poll would come after its deadline, and
    # the lock lapses just after its first acquisition was refused.
    client = await open_client(server_url)
    await seed_job(client)
    dead = await acquire_lock(client, WS, JOB, FIELD, "sigkilled")  # never released
    assert dead.acquired
    provider = GatedProvider()
    provider.gate.set()
    read, compute = cell(client, provider)
    started: list[float] = []
    lapsed_at: list[float] = []
    reads = 0

    async def check() -> JsonValue | None:
        nonlocal reads
        reads += 1
        if reads == 2:  # its acquisition was refused; it reads the cell once more, then waits
            lapsed_at.append(time.time())
            lock_clock.skip(LOCK_TTL)
        return await read()

    result = await compute_or_wait(
        client,
        provider,
        "w",
        wait=0.5,
        polling=LockPolling(initial_seconds=3600, max_seconds=3600),
        check=check,
        compute=timed(compute, started),
    )

    assert result.status == "computed"
    assert provider.calls == 1
    assert started[0] >= lapsed_at[0]  # not before the dead holder's lock lapsed
