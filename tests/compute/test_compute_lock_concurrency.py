"""The compute lock (layer 2) under real concurrency: racing tasks and processes against a real
server on loopback, on SQLite and on PostgreSQL; clocks that disagree; hostile lock requests; the
worker's TTL cache. The number that must stay at one: provider calls per cell."""

from __future__ import annotations

import asyncio
import contextvars
import json
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from pydantic import JsonValue

from cv_server import ServerConfig, create_app
from cv_server.cli import _with_schema
from cv_server.keys import STORES
from cv_workspace_client.compute import (
    ComputeResult,
    LockExpiringError,
    LockPolling,
    acquire_lock,
    compute_once,
    release_lock,
)
from cv_workspace_client.providers import ProviderResult, fake_answer
from cv_workspace_client.stage import StageRequest
from cv_workspace_client.stages.fake_provider import create_fake_provider_app
from cv_workspace_client.worker.parts import TtlCache, request_key
from tests.clocks import SkippingClock
from tests.pg.helpers import fresh_schema

from .conftest import OpenClient, ServerFactory, StartServer
from .helpers import (
    FIELD,
    JOB,
    LOCK_TTL,
    SECRET,
    WS,
    RequestLog,
    cell,
    cell_writes,
    compute_or_wait,
    holder_process,
    seed_job,
    stalled_after_acquiring,
    token_for,
)

FAST_POLL = LockPolling(initial_seconds=0.02, max_seconds=0.1)
RACERS = 16
PROMPT = f"{WS}/{JOB}/{FIELD}"  # this file's cell asks it; the value checks recompute its answer


# -- fixtures: a real server on SQLite or on PostgreSQL -------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """The storage part of a `ServerConfig`: a SQLite file, or a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        yield {"db_path": tmp_path / "cv.db"}
        return
    request.applymarker(pytest.mark.postgres)
    postgres_url: str = request.getfixturevalue("postgres_url")
    async with fresh_schema(postgres_url) as schema:
        yield {"database_url": _with_schema(postgres_url, schema)}


@pytest.fixture
def start_server(
    backend: dict[str, Any],
    aiohttp_server: ServerFactory,
    lock_clock: SkippingClock,
    monkeypatch: pytest.MonkeyPatch,
) -> StartServer:
    """`await start_server(*middlewares, **config)` → the base URL of a fresh server on the
    test's backend (several calls on PostgreSQL: several instances on one schema), its compute
    locks judged on `lock_clock`. `backend` comes first: the servers stop before their schema is
    dropped."""

    async def start(*middlewares: Any, **overrides: Any) -> str:
        app = create_app(ServerConfig(**{"token_secret": SECRET, **backend, **overrides}))
        for middleware in middlewares:
            app.middlewares.insert(0, middleware)
        server: TestServer = await aiohttp_server(app)
        lock_clock.drive(app[STORES].locks, monkeypatch)
        return str(server.make_url("")).rstrip("/")

    return start


# -- helpers ---------------------------------------------------------------------------------------


class HangingFirstProvider:
    """A provider whose first call never answers (until cancelled) and whose later calls answer
    at once; it counts calls and the most that were ever in flight together."""

    def __init__(self) -> None:
        self.calls = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.first_arrived = asyncio.Event()

    async def complete(
        self, prompt: str, *, model: str | None = None, **params: Any
    ) -> ProviderResult:
        self.calls += 1
        first = self.calls == 1
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            if first:
                self.first_arrived.set()
                await asyncio.Event().wait()
            text = fake_answer(prompt)
            return ProviderResult(text=text, raw={})
        finally:
            self.in_flight -= 1


# -- N racers, one call ----------------------------------------------------------------------------


async def test_sixteen_racing_tasks_pay_for_one_call_and_all_get_its_value(
    start_server: StartServer, open_client: OpenClient
) -> None:
    url = await start_server()
    clients = [await open_client(url) for _ in range(4)]
    await seed_job(clients[0])
    calls = 0
    arrived, release = asyncio.Event(), asyncio.Event()

    class Gated:
        async def complete(
            self, prompt: str, *, model: str | None = None, **params: Any
        ) -> ProviderResult:
            nonlocal calls
            calls += 1
            arrived.set()
            await release.wait()  # every racer is in flight before the answer exists
            return ProviderResult(text=fake_answer(prompt), raw={})

    provider = Gated()

    async def racer(i: int) -> ComputeResult[JsonValue]:
        client = clients[i % len(clients)]
        return await compute_or_wait(
            client, provider, f"w{i}", wait=20, polling=FAST_POLL, prompt=PROMPT
        )

    tasks = [asyncio.create_task(racer(i)) for i in range(RACERS)]
    async with asyncio.timeout(20):
        await arrived.wait()
    release.set()
    async with asyncio.timeout(30):
        results = await asyncio.gather(*tasks)

    assert calls == 1
    assert sorted(r.status for r in results).count("computed") == 1
    assert {r.value for r in results} == {fake_answer(f"{WS}/{JOB}/{FIELD}")}
    assert await cell_writes(clients[0]) == 1


_RACER_SCRIPT = """
import asyncio, json, sys
from cv_mutations import NodeUpdate
from cv_workspace_client import ClientConfig, WorkspaceClient
from cv_workspace_client.compute import LockPolling, compute_once
from cv_workspace_client.providers import OpenAICompatibleProvider

async def main(url, token, provider_url, tasks):
    config = ClientConfig(retry_base_seconds=0.005, retry_cap_seconds=0.05)
    async with WorkspaceClient(url, token=token, config=config) as client, \\
            OpenAICompatibleProvider(provider_url, model="fake") as provider:
        async def check():
            _, state = await client.get_state("ws1", "jobs")
            return state.nodes["job1"].fields.get("eval:fit")
        async def compute():
            answer = await provider.complete("the one prompt")
            await client.apply_op("ws1", "jobs",
                                  NodeUpdate(node_id="job1", set={"eval:fit": answer.text}))
            return answer.text
        async def racer(i):
            result = await compute_once(client, "ws1", "job1", "eval:fit", check=check,
                                        compute=compute, holder=f"p{i}", sub_doc="jobs",
                                        wait=30, polling=LockPolling(0.02, 0.2))
            return [result.status, result.value]
        print("ready", flush=True)
        sys.stdin.readline()  # the starting gun: every process races at once
        print(json.dumps(await asyncio.gather(*(racer(i) for i in range(tasks)))), flush=True)

asyncio.run(main(*sys.argv[1:4], int(sys.argv[4])))
"""


async def test_sixteen_racers_in_four_processes_pay_for_one_call(
    start_server: StartServer,
    open_client: OpenClient,
    aiohttp_server: ServerFactory,
    tmp_path: Path,
) -> None:
    url = await start_server()
    client = await open_client(url)
    await seed_job(client)
    fake = await aiohttp_server(create_fake_provider_app(delay=0.3))
    provider_url = str(fake.make_url("/v1"))
    script = tmp_path / "racer.py"
    script.write_text(_RACER_SCRIPT)
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            url,
            token_for(WS),
            provider_url,
            str(RACERS // 4),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        for _ in range(4)
    ]
    try:
        async with asyncio.timeout(60):
            for proc in procs:
                assert proc.stdout is not None
                assert (await proc.stdout.readline()).strip() == b"ready"
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write(b"go\n")
                await proc.stdin.drain()
            outputs = [await proc.stdout.readline() for proc in procs if proc.stdout]
            for proc in procs:
                await proc.wait()
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    results = [item for line in outputs for item in json.loads(line)]
    async with aiohttp.ClientSession() as session, session.get(fake.make_url("/stats")) as resp:
        stats = await resp.json()
    assert len(results) == RACERS
    assert stats["calls"] == 1
    assert [status for status, _ in results].count("computed") == 1
    assert {value for _, value in results} == {fake_answer("the one prompt")}
    assert await cell_writes(client) == 1


async def test_a_sigkilled_holder_is_taken_over_by_exactly_one_of_eight_waiters_after_its_ttl(
    start_server: StartServer,
    open_client: OpenClient,
    lock_clock: SkippingClock,
    tmp_path: Path,
) -> None:
    log = RequestLog()
    url = await start_server(log.middleware)  # the real 60 s TTL: the survivor's lock outlasts it
    clients = [await open_client(url) for _ in range(2)]
    await seed_job(clients[0])
    async with holder_process(url, tmp_path) as proc:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            assert (await proc.stdout.readline()).strip() == b"calling"
    dead = await acquire_lock(clients[0], WS, JOB, FIELD, "probe")
    assert not dead.acquired
    assert (dead.holder or "").startswith("doomed#")
    started: list[float] = []

    class Instant:
        async def complete(
            self, prompt: str, *, model: str | None = None, **params: Any
        ) -> ProviderResult:
            started.append(time.time())
            return ProviderResult(text=fake_answer(prompt), raw={})

    async def waiter(i: int) -> ComputeResult[JsonValue]:
        client = clients[i % 2]
        return await compute_or_wait(
            client, Instant(), f"w{i}", wait=15, polling=FAST_POLL, prompt=PROMPT
        )

    waiters = [asyncio.create_task(waiter(i)) for i in range(8)]
    await log.wait_for(lambda log: len(log.locked) >= 1 + 8)  # the probe's, and the waiters'
    lapsed_at = time.time()
    lock_clock.skip(LOCK_TTL)  # the dead holder's lock lapses now, with the waiters waiting
    async with asyncio.timeout(30):
        results = await asyncio.gather(*waiters)

    assert len(started) == 1  # one survivor paid, once
    assert started[0] >= lapsed_at  # not before the dead holder's lock lapsed
    assert [r.status for r in results].count("computed") == 1
    assert {r.value for r in results} == {fake_answer(f"{WS}/{JOB}/{FIELD}")}
    assert await cell_writes(clients[0]) == 1


# -- a compute that runs longer than the lock, and worker clocks that disagree with the server -----


@pytest.mark.parametrize("worker_skew", [0.0, -30.0], ids=["same-clock", "worker-30s-behind"])
async def test_a_compute_longer_than_the_lock_is_cancelled_before_a_racer_can_take_over(
    start_server: StartServer,
    open_client: OpenClient,
    worker_skew: float,
) -> None:
    # No heartbeat extends a compute lock (a 60 s TTL, nothing else). What keeps a
    # second paid call from overlapping the first is the holder's budget: it cancels its own
    # compute before the lock can lapse. A worker whose wall clock is behind the server's must
    # not compute its budget from the server's `expires_at` against its own clock: the lock
    # would lapse (server time) while the holder still thinks it has half a minute left.
    # The holder's clock jumps between its acquisition and its compute (a paused process) to
    # leave it half a second of its budget, while the server's lock keeps its whole TTL: the
    # racer gets the key only if the holder cancels and hands it back. Judged from `expires_at`
    # on the clock 30 s behind, the budget would be half a minute, and the racer would give up.
    url = await start_server()
    clients = [await open_client(url) for _ in range(2)]
    await seed_job(clients[0])
    provider = HangingFirstProvider()
    check, compute = cell(clients[0], provider, prompt=PROMPT)
    worker = SkippingClock()
    worker.skip(worker_skew)

    holder = asyncio.create_task(
        compute_once(
            clients[0],
            WS,
            JOB,
            FIELD,
            check=stalled_after_acquiring(check, worker),
            compute=compute,
            holder="slow",
            now=worker.now,
        )
    )
    async with asyncio.timeout(10):
        await provider.first_arrived.wait()
    racer = asyncio.create_task(
        compute_or_wait(clients[1], provider, "next", wait=10, polling=FAST_POLL, prompt=PROMPT)
    )
    try:
        async with asyncio.timeout(15):
            result = await racer
        assert result.status == "computed"
        assert provider.calls == 2  # the holder's cancelled call was paid for: by design
        assert provider.peak_in_flight == 1  # but the racer's never overlapped it
        async with asyncio.timeout(5):
            with pytest.raises(LockExpiringError):
                await holder
    finally:
        holder.cancel()
    assert await cell_writes(clients[0]) == 1


async def test_a_worker_whose_clock_is_ahead_of_the_server_still_computes(
    start_server: StartServer, open_client: OpenClient
) -> None:
    url = await start_server()  # the real 60 s TTL
    client = await open_client(url)
    await seed_job(client)
    provider = HangingFirstProvider()
    provider.calls = 1  # every call answers at once
    check, compute = cell(client, provider, prompt=PROMPT)

    result = await compute_once(
        client,
        WS,
        JOB,
        FIELD,
        check=check,
        compute=compute,
        holder="w",
        now=lambda: time.time() + 120,
    )

    assert result.status == "computed"


_SERVER_SKEW: contextvars.ContextVar[float] = contextvars.ContextVar("server_skew", default=0.0)


@pytest.fixture
async def pg_dsn(postgres_url: str) -> AsyncIterator[str]:
    async with fresh_schema(postgres_url) as schema:
        yield _with_schema(postgres_url, schema)


@pytest.mark.postgres
async def test_an_instance_whose_clock_is_ahead_does_not_take_over_a_live_lock(
    pg_dsn: str,
    aiohttp_server: ServerFactory,
    open_client: OpenClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two cv-server instances on one database; the second's clock runs 90 s ahead (NTP off, a
    # VM resumed). The database is the one clock they share: the lock's expiry is judged on it,
    # not on whichever instance happens to answer.
    real_time = time.time

    def instance_clock() -> float:
        return real_time() + _SERVER_SKEW.get()

    monkeypatch.setattr(time, "time", instance_clock)

    @web.middleware
    async def ahead(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        _SERVER_SKEW.set(90.0)
        return await handler(request)

    config = ServerConfig(token_secret=SECRET, database_url=pg_dsn)
    urls = []
    for middlewares in ([], [ahead]):
        app = create_app(config)
        app.middlewares[0:0] = middlewares
        server = await aiohttp_server(app)
        urls.append(str(server.make_url("")).rstrip("/"))
    on_time, ahead_client = [await open_client(u) for u in urls]

    first = await acquire_lock(on_time, WS, JOB, FIELD, "a")
    second = await acquire_lock(ahead_client, WS, JOB, FIELD, "b")
    third = await acquire_lock(on_time, WS, JOB, FIELD, "c")

    assert first.acquired
    assert not second.acquired  # the lock is 0 s old, whatever that instance's clock says
    assert not third.acquired
    assert first.token is not None
    assert not await release_lock(ahead_client, WS, JOB, FIELD, "forged")
    assert await release_lock(ahead_client, WS, JOB, FIELD, first.token)


async def test_a_partitioned_holders_late_release_does_not_free_the_new_holders_lock(
    start_server: StartServer, open_client: OpenClient, lock_clock: SkippingClock
) -> None:
    url = await start_server()  # the real 60 s TTL: the new holder's lock outlasts the test
    old_client, new_client = [await open_client(url) for _ in range(2)]
    old = await acquire_lock(old_client, WS, JOB, FIELD, "partitioned")
    assert old.acquired
    assert old.token is not None
    lock_clock.skip(LOCK_TTL)  # the partition outlasts the old holder's lock
    new = await acquire_lock(new_client, WS, JOB, FIELD, "new")
    assert new.acquired
    assert new.token is not None

    assert not await release_lock(old_client, WS, JOB, FIELD, old.token)  # late, fenced out
    assert not await release_lock(old_client, WS, JOB, FIELD, old.token)  # and again
    assert not (await acquire_lock(old_client, WS, JOB, FIELD, "third")).acquired
    assert await release_lock(new_client, WS, JOB, FIELD, new.token)
    assert not await release_lock(new_client, WS, JOB, FIELD, new.token)  # double release


# -- hostile lock requests -------------------------------------------------------------------------


_BAD_REQUESTS: list[tuple[str, str, bytes, int, str]] = [
    ("acquire", "not json", b"{", 400, "malformed_json"),
    ("acquire", "not utf-8", b'{"job_id": "\xff", "task": "t"}', 400, "malformed_json"),
    ("acquire", "lone surrogate", b'{"job_id": "\\ud800", "task": "t"}', 400, "malformed_json"),
    ("acquire", "NaN", b'{"job_id": "j", "task": "t", "ttl": NaN}', 400, "malformed_json"),
    ("acquire", "array body", b"[]", 400, "malformed_json"),
    ("acquire", "empty job", b'{"job_id": "", "task": "t"}', 422, "invalid_field"),
    ("acquire", "job not text", b'{"job_id": 1, "task": "t"}', 422, "invalid_field"),
    (
        "acquire",
        "huge task",
        json.dumps({"job_id": "j", "task": "t" * 257}).encode(),
        422,
        "invalid_field",
    ),
    ("acquire", "NUL task", b'{"job_id": "j", "task": "a\\u0000b"}', 422, "invalid_field"),
    (
        "acquire",
        "huge holder",
        json.dumps({"job_id": "j", "task": "t", "holder": "h" * 257}).encode(),
        422,
        "invalid_field",
    ),
    ("release", "no token", b'{"job_id": "j", "task": "t"}', 422, "invalid_field"),
    (
        "release",
        "token not text",
        b'{"job_id": "j", "task": "t", "token": 5}',
        422,
        "invalid_field",
    ),
    (
        "release",
        "NUL token",
        b'{"job_id": "j", "task": "t", "token": "\\u0000"}',
        422,
        "invalid_field",
    ),
]


async def test_hostile_lock_requests_get_stable_4xx_codes_and_change_nothing(
    start_server: StartServer, open_client: OpenClient
) -> None:
    url = await start_server()
    client = await open_client(url)
    held = await acquire_lock(client, WS, "j", "t", "holder")
    assert held.acquired
    assert held.token is not None
    headers = {"Authorization": f"Bearer {token_for(WS)}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:
        for verb, name, body, status, code in _BAD_REQUESTS:
            async with session.post(
                f"{url}/v1/workspaces/{WS}/locks/{verb}", data=body, headers=headers
            ) as resp:
                problem = await resp.json(content_type=None)
                assert (resp.status, problem.get("code")) == (status, code), name
        # A caller's TTL is not the server's to take: any ttl in the body is ignored.
        for i, ttl in enumerate(("-1", "0", "1e308", '"forever"')):
            body = f'{{"job_id": "j2", "task": "t{i}", "ttl": {ttl}}}'.encode()
            async with session.post(
                f"{url}/v1/workspaces/{WS}/locks/acquire", data=body, headers=headers
            ) as resp:
                answer = await resp.json()
                assert resp.status == 200
                assert answer["acquired"] is True
                assert math.isfinite(answer["expires_at"])
                assert answer["ttl"] == LOCK_TTL, ttl  # the server's own
                assert answer["expires_in"] == pytest.approx(LOCK_TTL), ttl
        # Another workspace's path, with this workspace's token: refused, key untouched.
        async with session.post(
            f"{url}/v1/workspaces/other/locks/release",
            json={"job_id": "j", "task": "t", "token": held.token},
            headers=headers,
        ) as resp:
            assert resp.status == 403
    # Nothing was half-applied: the held lock is still held, by its holder, and releasable once.
    again = await acquire_lock(client, WS, "j", "t", "someone-else")
    assert not again.acquired
    assert again.holder == "holder"
    assert await release_lock(client, WS, "j", "t", held.token)
    assert not await release_lock(client, WS, "j", "t", held.token)


async def test_the_same_key_in_two_workspaces_is_two_locks_and_two_cells(
    start_server: StartServer, open_client: OpenClient
) -> None:
    url = await start_server()
    client = await open_client(url, WS, "ws2")
    a = await acquire_lock(client, WS, JOB, FIELD, "a")
    b = await acquire_lock(client, "ws2", JOB, FIELD, "b")
    assert a.acquired
    assert b.acquired
    assert a.token is not None
    assert not await release_lock(client, "ws2", JOB, FIELD, a.token)  # a token is per key


# -- the worker's TTL cache ------------------------------------------------------------------------


def _request(workspace_id: str, input: Any = None) -> StageRequest:
    return StageRequest(
        request_id="r",
        workspace_id=workspace_id,
        stage="evaluate",
        job_id=JOB,
        branch_path=None,
        input=input,
        run=1,
        dequeue_count=1,
        created_at=0.0,
        claimed_at=None,
    )


def test_the_ttl_cache_holds_500_entries_evicting_the_oldest_first() -> None:
    clock = [0.0]
    cache: TtlCache[int] = TtlCache(500, lambda: clock[0])
    for i in range(501):
        cache.put(i, i, ttl=10)
        clock[0] += 0.001
    assert len(cache) == 500
    assert cache.get(0) == (False, None)
    assert cache.get(1) == (True, 1)
    assert cache.get(500) == (True, 500)
    clock[0] += 10
    assert cache.get(500) == (False, None)  # expired
    assert len(cache) == 499


def test_request_keys_of_different_workspaces_never_collide() -> None:
    # Workspace ids cannot hold the JSON framing characters, but even crafted inputs that
    # "continue" a workspace id stay distinct: the key is a JSON array, not a concatenation.
    assert request_key(_request("ws1", ["x"])) != request_key(_request("ws2", ["x"]))
    assert request_key(_request("ws1", "ws2")) != request_key(_request("ws2", "ws1"))
    assert request_key(_request("ws1", math.nan)) is None  # never cached at all
