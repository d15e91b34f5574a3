"""Acceptance: schedules fired by real `cv-server` processes, the scheduler killed mid-way
(docs/queue.md, "Schedules").

- Two instances on one PostgreSQL database, two schedules due every second for 20 s; the
  instance holding the scheduler lease is SIGKILLed mid-way. Every due time of the window is
  enqueued exactly once, except where the missed-run policy says (`all`: no gap; `skip`: a gap
  exactly while no instance held the lease), and the other instance takes the lease over within
  one lease of the kill.
- The same on the embedded SQLite file, the one server SIGKILLed and restarted.

The lease and heartbeat are shrunk by `--set`; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.cli import _with_schema
from cv_server.schedules.model import firing_request_id
from tests.acceptance.procs import (
    ServerProcess,
    create_sqlite_database,
    free_port,
    mint_cli_token,
)
from tests.pg.helpers import fresh_schema

pytestmark = pytest.mark.acceptance

WS = "sched"
HEARTBEAT_S = 0.5
LEASE_S = 2.0
SETTINGS = (
    f"scheduler_heartbeat_seconds={HEARTBEAT_S}",
    f"scheduler_lease_seconds={LEASE_S}",
)
#: How long the schedules run in all, and when (from their first due time) the scheduler dies.
WINDOW_S = 20.0
KILL_AT_S = 8.0
#: The SQLite server stays down this long before its restart.
DOWN_S = 3.0
#: How late the scheduler loop may be to its wake-up (event-loop and process scheduling on a
#: shared machine): the tolerance on "within the lease" and on a due time's side of the kill.
JITTER_S = 0.5


async def _api(
    session: aiohttp.ClientSession, method: str, url: str, status: int, **kwargs: Any
) -> Any:
    async with session.request(method, url, **kwargs) as resp:
        assert resp.status == status, await resp.text()
        return await resp.json(content_type=None)


async def _add_schedules(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    added = {}
    for name, missed in (("every", "all"), ("skipper", "skip")):
        body = {
            "name": name,
            "interval_seconds": 1,
            "missed": missed,
            "overlap": "queue",
            "enqueue": {"stage": "tick", "input": {"schedule": name}},
        }
        added[name] = await _api(
            session, "POST", f"{url}/v1/workspaces/{WS}/schedules", 201, json=body
        )
    return added


async def _request_ids(session: aiohttp.ClientSession, url: str) -> list[str]:
    ids: list[str] = []
    after = None
    while True:
        params = {"workspace": WS, "limit": "1000", **({"after": after} if after else {})}
        page = await _api(session, "GET", f"{url}/v1/queue/requests", 200, params=params)
        ids += [row["request_id"] for row in page["requests"]]
        after = page["next_after"]
        if after is None:
            return ids


async def _stop_firing(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """Pause both schedules (the end of the window) and return them as they stand."""
    return {
        name: await _api(session, "POST", f"{url}/v1/workspaces/{WS}/schedules/{name}/pause", 200)
        for name in ("every", "skipper")
    }


def _check_window(
    added: dict[str, Any],
    stopped: dict[str, Any],
    request_ids: list[str],
    *,
    dead_from: float,
    dead_until: float,
) -> None:
    """Every due time from each schedule's first to its last firing is enqueued exactly once,
    except `skipper`'s due times while no scheduler ran (`dead_from`..`dead_until`). A firing
    under way when the schedules were paused may have enqueued one due time past the last one
    they record: the last firing is read from the requests themselves."""
    assert len(request_ids) == len(set(request_ids)), "a request listed twice"
    ids = set(request_ids)
    expected: set[str] = set()
    for name, schedule in added.items():
        first = schedule["next_fire_at"]
        slots = [first + k for k in range(int(WINDOW_S) + 10)]
        fired = {s for s in slots if firing_request_id(WS, schedule["schedule_id"], s) in ids}
        top = max(fired)
        assert top >= stopped[name]["last_fired_at"]
        assert top - first >= WINDOW_S - 2, f"{name}: fired only until {top - first} s"
        window = {s for s in slots if s <= top}
        if name == "every":  # missed: all: no gap, the down time caught up
            assert fired == window, sorted(window - fired)
        else:  # missed: skip: a gap exactly while no scheduler ran
            clearly_live = {s for s in window if s < dead_from - JITTER_S or s >= dead_until}
            clearly_dead = {s for s in window if dead_from + JITTER_S < s < dead_until}
            assert clearly_live <= fired, sorted(clearly_live - fired)
            assert not (clearly_dead & fired), sorted(clearly_dead & fired)
            assert clearly_dead, "the kill left no gap to test"
        expected |= {firing_request_id(WS, schedule["schedule_id"], s) for s in fired}
    # Nothing else was enqueued: no due time twice under another id, none outside the window.
    assert ids == expected


# -- PostgreSQL: two instances ---------------------------------------------------------------


@pytest.fixture
async def schema(postgres_url: str) -> AsyncIterator[str]:
    async with fresh_schema(postgres_url) as name:
        yield name


async def _lease(url: str) -> asyncpg.Record | None:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchrow("SELECT owner, held_since FROM scheduler_leases")
    finally:
        await conn.close()


@pytest.mark.postgres
@pytest.mark.timeout(120)
async def test_two_instances_fire_each_due_time_once_across_a_sigkill_of_the_holder(
    postgres_url: str, schema: str, tmp_path: Path
) -> None:
    url = _with_schema(postgres_url, schema)
    servers = [
        ServerProcess(
            None, free_port(), tmp_path / f"s{i}.log", database_url=url, settings=SETTINGS
        )
        for i in range(2)
    ]
    try:
        await asyncio.gather(*(asyncio.to_thread(s.start) for s in servers))
        token = await asyncio.to_thread(mint_cli_token, None, WS, database_url=url)
        headers = {"Authorization": f"Bearer {token}"}
        async with aiohttp.ClientSession(headers=headers) as session:
            added = await _add_schedules(session, servers[0].url)
            start = min(s["next_fire_at"] for s in added.values())
            await asyncio.sleep(max(0.0, start + KILL_AT_S - time.time()))
            lease = await _lease(url)
            assert lease is not None
            pids = [s.proc.pid for s in servers if s.proc is not None]
            holder = next(i for i, pid in enumerate(pids) if f":{pid}:" in lease["owner"])
            other = servers[1 - holder]
            killed_at = time.time()
            await asyncio.to_thread(servers[holder].kill)
            # The other instance takes the lease over within one lease of the kill.
            deadline = time.monotonic() + LEASE_S + 5
            while True:
                lease = await _lease(url)
                assert lease is not None
                if f":{pids[1 - holder]}:" in lease["owner"]:
                    break
                assert time.monotonic() < deadline, "no takeover"
                await asyncio.sleep(0.1)
            taken_at = lease["held_since"]
            assert taken_at - killed_at <= LEASE_S + JITTER_S
            await asyncio.sleep(max(0.0, start + WINDOW_S - time.time()))
            stopped = await _stop_firing(session, other.url)
            request_ids = await _request_ids(session, other.url)
    finally:
        for server in servers:
            await asyncio.to_thread(server.stop)
    _check_window(added, stopped, request_ids, dead_from=killed_at, dead_until=taken_at)


# -- SQLite: one server, restarted -----------------------------------------------------------


@pytest.mark.timeout(120)
async def test_the_embedded_server_fires_each_due_time_once_across_a_sigkill_and_restart(
    tmp_path: Path,
) -> None:
    db = tmp_path / "cv.db"
    await asyncio.to_thread(create_sqlite_database, db)
    server = ServerProcess(db, free_port(), tmp_path / "server.log", settings=SETTINGS)
    try:
        await asyncio.to_thread(server.start)
        token = await asyncio.to_thread(mint_cli_token, db, WS)
        headers = {"Authorization": f"Bearer {token}"}
        async with aiohttp.ClientSession(headers=headers) as session:
            added = await _add_schedules(session, server.url)
            start = min(s["next_fire_at"] for s in added.values())
            await asyncio.sleep(max(0.0, start + KILL_AT_S - time.time()))
            killed_at = time.time()
            await asyncio.to_thread(server.kill)
            await asyncio.sleep(DOWN_S)
            await asyncio.to_thread(server.start)
            # The restarted scheduler takes the lease as it starts, maybe just after it listens.
            deadline = time.monotonic() + 10
            while (restarted_at := await asyncio.to_thread(_sqlite_held_since, db)) < killed_at:
                assert time.monotonic() < deadline, "the restarted server took no lease"
                await asyncio.sleep(0.05)
            await asyncio.sleep(max(0.0, start + WINDOW_S - time.time()))
            stopped = await _stop_firing(session, server.url)
            request_ids = await _request_ids(session, server.url)
    finally:
        await asyncio.to_thread(server.stop)
    _check_window(added, stopped, request_ids, dead_from=killed_at, dead_until=restarted_at)


def _sqlite_held_since(db: Path) -> float:
    """When the server took the scheduler lease (0 while none holds it)."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        row = conn.execute("SELECT held_since FROM scheduler_leases").fetchone()
    return 0.0 if row is None else float(row[0])
