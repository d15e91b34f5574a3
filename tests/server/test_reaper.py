"""The background pass (`cv_server.reaper`, docs/operating.md "Queue rows") on both backends:
what outlived its retention goes, in bounded batches, until a batch comes back short; what is
live, recent or poison stays."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.backends import open_stores
from cv_server.keys import STORES
from cv_server.locks import Acquired
from cv_server.queue import NewRequest, ProcessRequest, QueueStore, deterministic_request_id
from cv_server.reaper import batches, reap_once
from cv_server.stores import Stores
from tests.server.conftest import ClientFactory

RETENTION = 1000.0
WS = "ws1"


@pytest.fixture
async def config(make_server_config: Callable[..., ServerConfig]) -> ServerConfig:
    return make_server_config(request_retention_seconds=RETENTION)


@pytest.fixture
async def stores(config: ServerConfig) -> AsyncIterator[Stores]:
    stores = await open_stores(config)
    yield stores
    await stores.close()


def _request(job: str, max_dequeues: int = 5) -> NewRequest:
    return NewRequest(
        workspace_id=WS,
        stage="s",
        request_id=deterministic_request_id(WS, job, None, "s"),
        input=None,
        job_id=job,
        branch_path=None,
        max_dequeues=max_dequeues,
    )


async def _finish(
    queue: QueueStore, job: str, at: float, *, poison: bool = False
) -> ProcessRequest:
    await queue.enqueue(_request(job, 1 if poison else 5), at)
    held = await queue.claim("s", "w", 60.0, at)
    assert held is not None
    assert held.job_id == job
    if poison:
        return await queue.fail(held.request_id, held.claim_token or "", None, 1.0, at)
    return await queue.complete(held.request_id, held.claim_token or "", {"ok": 1}, at)


async def test_a_pass_deletes_what_outlived_its_retention_until_caught_up(
    stores: Stores, config: ServerConfig
) -> None:
    now = await stores.queue.clock()
    old = [await _finish(stores.queue, f"old-{i}", now - 2 * RETENTION) for i in range(25)]
    recent = await _finish(stores.queue, "recent", now - RETENTION / 2)
    poison = await _finish(stores.queue, "poison", now - 2 * RETENTION, poison=True)
    lock_now = await stores.locks.clock()
    live = await stores.locks.acquire(WS, "job", "live", "w", 600.0, lock_now)
    assert isinstance(live, Acquired)
    for i in range(12):  # acquired after the live one: its acquisition swept none of them
        dead = await stores.locks.acquire(WS, "job", f"dead-{i}", "w", 1.0, lock_now - 10)
        assert isinstance(dead, Acquired)
    # Revocations of tokens expired since go; one of a token still alive, or of one that
    # never expires, stays (docs/operating.md, "Revoking a token").
    expired_at = int(time.time()) - 10
    await stores.revocations.revoke(f"{expired_at}-{'a' * 24}", expired_at)
    await stores.revocations.revoke(f"{expired_at + 3600}-{'b' * 24}", expired_at + 3600)
    await stores.revocations.revoke(f"never-{'c' * 24}", None)

    report = await reap_once(batches(stores, config), 10)  # three batches of requests
    assert report.caught_up
    assert report.deleted == {
        "idempotency_keys": 0,
        "blobs": 0,
        "requests": 25,
        "compute_locks": 12,
        "token_revocations": 1,
    }
    kept_ids = [entry.token_id for entry in await stores.revocations.revoked_since(0)]
    assert kept_ids == [f"{expired_at + 3600}-{'b' * 24}", f"never-{'c' * 24}"]
    assert all([await stores.queue.get(WS, row.request_id) is None for row in old])
    for kept in (recent, poison):
        assert await stores.queue.get(WS, kept.request_id) == kept
    assert await stores.locks.get(WS, "job", "live", lock_now) is not None
    again = await reap_once(batches(stores, config), 10)
    assert sum(again.deleted.values()) == 0


async def test_a_pass_still_behind_at_its_budget_says_so_and_the_next_goes_on(
    stores: Stores, config: ServerConfig
) -> None:
    now = await stores.queue.clock()
    for i in range(30):
        await _finish(stores.queue, f"old-{i}", now - 2 * RETENTION)
    ticks = itertools.count()
    clock: Callable[[], float] = lambda: float(next(ticks))  # noqa: E731 - a fake clock

    first = await reap_once(batches(stores, config), 4, budget=3.0, monotonic=clock)
    assert not first.caught_up
    assert 0 < first.deleted["requests"] < 30
    rest = await reap_once(batches(stores, config), 4)
    assert rest.caught_up
    assert first.deleted["requests"] + rest.deleted["requests"] == 30


async def test_a_retention_of_zero_keeps_finished_requests_forever(
    make_server_config: Callable[..., ServerConfig],
) -> None:
    config = make_server_config(request_retention_seconds=0)
    stores = await open_stores(config)
    try:
        now = await stores.queue.clock()
        row = await _finish(stores.queue, "ancient", now - 10 * 365 * 24 * 3600.0)
        report = await reap_once(batches(stores, config), 10)
        assert report.deleted["requests"] == 0
        assert await stores.queue.get(WS, row.request_id) == row
    finally:
        await stores.close()


async def test_the_server_reaps_in_the_background_and_counts_it_by_kind(
    aiohttp_client: ClientFactory, make_server_config: Callable[..., ServerConfig]
) -> None:
    config = make_server_config(request_retention_seconds=RETENTION, reap_seconds=0.05)
    server: TestClient[Any, Any] = await aiohttp_client(create_app(config))
    queue = server.app[STORES].queue
    now = await queue.clock()
    for i in range(3):
        await _finish(queue, f"old-{i}", now - 2 * RETENTION)
    found = None
    for _ in range(400):  # the pass runs every 50 ms: poll until it has, at most ~20 s
        text = await (await server.get("/metrics")).text()
        found = re.search(r'^cv_reaped_rows_total\{kind="requests"\} (\S+)$', text, re.M)
        if found and float(found[1]) == 3.0:
            break
        await asyncio.sleep(0.05)
    assert found is not None
    assert float(found[1]) == 3.0
    assert re.search(r'^cv_reap_pass_rows\{kind="compute_locks"\} 0\.0$', text, re.M)
    assert re.search(r"^cv_reap_pass_seconds_count \d", text, re.M)
    assert await queue.list() == []
