"""The scheduler loop (`cv_server.schedules.firing.Scheduler`) on a real SQLite file: the lease
passes on a clean stop, an idle scheduler logs nothing per round, and a schedule that cannot
fire neither stops the others nor floods the log.

Waits are bounded: each test waits for an outcome (a firing, a lease change) up to a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import sqlite_utils

from cv_server.schedules.firing import LEASE_NAME, Scheduler
from cv_server.schedules.model import Schedule, ScheduleSpec
from cv_server.sqlite import queue as queue_sqlite
from cv_server.sqlite import schedules as schedules_sqlite
from cv_server.sqlite.engine import SQLiteDatabase
from cv_server.sqlite.queue import SQLiteQueueStore
from cv_server.sqlite.schedules import SQLiteScheduleStore

WS = "ws"
HEARTBEAT = 0.2
DEADLINE = 10.0


def schema(db: sqlite_utils.Database) -> None:
    queue_sqlite.create_schema(db)
    schedules_sqlite.create_schema(db)


@pytest.fixture
async def database(tmp_path: Path) -> AsyncIterator[SQLiteDatabase]:
    db = await SQLiteDatabase.open(tmp_path / "cv.db", schema=schema)
    yield db
    await db.close()


def scheduler(db: SQLiteDatabase, owner: str, *, sole: bool = False) -> Scheduler:
    return Scheduler(
        SQLiteScheduleStore(db),
        SQLiteQueueStore(db),
        owner=owner,
        lease_seconds=3 * HEARTBEAT,
        heartbeat_seconds=HEARTBEAT,
        recheck_seconds=HEARTBEAT,
        catch_up_limit=10,
        max_dequeues=5,
        sole_instance=sole,
    )


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.05)


async def test_a_cleanly_stopped_holder_hands_the_lease_on_at_once(
    database: SQLiteDatabase,
) -> None:
    store = SQLiteScheduleStore(database)
    first, second = scheduler(database, "first"), scheduler(database, "second")
    first.start()

    async def held_by_first() -> bool:
        return first.holding

    await until(held_by_first, "the first holds the lease")
    second.start()
    try:
        await asyncio.sleep(2 * HEARTBEAT)
        assert not second.holding  # a live holder keeps it
        lease = await store.hold_lease(LEASE_NAME, "probe", 1.0, time.time())
        assert lease.owner == "first"
        await first.close()

        async def held_by_second() -> bool:
            return second.holding

        await until(held_by_second, "the second takes the lease over")
    finally:
        await first.close()
        await second.close()


async def test_an_idle_scheduler_logs_nothing_after_taking_the_lease(
    database: SQLiteDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="cv_server.schedules")
    loop = scheduler(database, "embedded", sole=True)
    loop.start()
    try:
        await asyncio.sleep(10 * HEARTBEAT)  # ten heartbeats, no schedule
    finally:
        await loop.close()
    assert [r.getMessage() for r in caplog.records] == ["scheduler: lease taken"]


async def test_a_schedule_that_cannot_fire_is_logged_once_and_stops_no_other(
    database: SQLiteDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="cv_server.schedules")
    store, queue = SQLiteScheduleStore(database), SQLiteQueueStore(database)
    now = time.time()
    # max_dequeues 0: every firing's request is refused by the queue's own rule.
    broken = ScheduleSpec(WS, "broken", {"stage": "s", "max_dequeues": 0}, interval_seconds=1)
    await store.add(broken, "sch-broken", now)
    good = await store.add(
        ScheduleSpec(WS, "good", {"stage": "s"}, interval_seconds=1, overlap="queue"),
        "sch-good",
        now,
    )
    loop = scheduler(database, "embedded", sole=True)
    loop.start()
    try:

        async def good_fired_thrice() -> bool:
            return len(await queue.list(workspace_id=WS)) >= 3

        await until(good_fired_thrice, "the good schedule fired three times")
    finally:
        await loop.close()
    rows = await queue.list(workspace_id=WS)
    assert {row.stage for row in rows} == {"s"}
    assert all(row.max_dequeues == 5 for row in rows)  # all the good one's
    after = await store.get(WS, "good")
    assert after is not None
    assert after.next_fire_at is not None
    assert good.next_fire_at is not None
    assert after.next_fire_at > good.next_fire_at
    failures = [r for r in caplog.records if "could not fire" in r.getMessage()]
    assert len(failures) == 1


class CountingStore(SQLiteScheduleStore):
    """Counts the reads of due schedules: how often the loop wakes to look."""

    reads = 0

    async def due(self, now: float, *, limit: int) -> list[Schedule]:
        self.reads += 1
        return await super().due(now, limit=limit)


async def test_an_idle_embedded_scheduler_looks_once_a_heartbeat_not_every_recheck(
    database: SQLiteDatabase,
) -> None:
    store = CountingStore(database)
    loop = Scheduler(
        store,
        SQLiteQueueStore(database),
        owner="embedded",
        lease_seconds=3 * HEARTBEAT,
        heartbeat_seconds=HEARTBEAT,
        recheck_seconds=0.01,  # what several instances would re-read at
        catch_up_limit=10,
        max_dequeues=5,
        sole_instance=True,
    )
    loop.start()
    try:
        await asyncio.sleep(10 * HEARTBEAT)
    finally:
        await loop.close()
    assert store.reads <= 12  # ten heartbeats (and the first look); a re-read loop made ~200
