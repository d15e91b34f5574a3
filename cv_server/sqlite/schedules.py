"""Schedules and the scheduler lease on the embedded SQLite database (docs/queue.md, "Schedules").

Each verb that writes is one write job on the single writer thread, so a read-then-write (resume
computes the next due time from the stored spec) never interleaves with another writer.
"""

from __future__ import annotations

import builtins
import json
import sqlite3
import time
from typing import Any, Final

import sqlite_utils

from cv_server.schedules.model import Schedule, ScheduleSpec, anchor_for, first_slot
from cv_server.schedules.store import (
    Lease,
    ScheduleExists,
    ScheduleNotFound,
    ScheduleStore,
    check_lease_ttl,
)
from cv_server.sqlite.engine import SQLiteDatabase, Transaction

__all__ = ["SQLiteScheduleStore", "create_schema"]

TABLE: Final = "schedules"
LEASES: Final = "scheduler_leases"

_COLUMNS: Final = (
    "schedule_id, workspace_id, name, cron, interval_seconds, enqueue, missed, overlap,"
    " paused, enqueue_grant, created_at, anchor, next_fire_at, last_fired_at,"
    " last_request_id, skipped"
)


def create_schema(db: sqlite_utils.Database) -> None:
    """Create the schedule and lease tables and their indexes if missing (idempotent)."""
    db.execute(
        f"""CREATE TABLE IF NOT EXISTS {TABLE} (
            schedule_id TEXT PRIMARY KEY,
            workspace_id TEXT NOT NULL,
            name TEXT NOT NULL,
            cron TEXT,
            interval_seconds INTEGER,
            enqueue TEXT NOT NULL,
            missed TEXT NOT NULL,
            overlap TEXT NOT NULL,
            paused INTEGER NOT NULL,
            enqueue_grant TEXT,
            created_at REAL NOT NULL,
            anchor REAL NOT NULL,
            next_fire_at REAL,
            last_fired_at REAL,
            last_request_id TEXT,
            skipped INTEGER NOT NULL DEFAULT 0,
            UNIQUE (workspace_id, name)
        )"""
    )
    # The scheduler's `due` / `next_due_at`: running schedules by due time.
    db.execute(
        f"CREATE INDEX IF NOT EXISTS {TABLE}_due ON {TABLE} (next_fire_at)"
        " WHERE next_fire_at IS NOT NULL"
    )
    db.execute(
        f"""CREATE TABLE IF NOT EXISTS {LEASES} (
            name TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            expires_at REAL NOT NULL,
            held_since REAL NOT NULL
        )"""
    )


def _row(row: sqlite3.Row | tuple[Any, ...]) -> Schedule:
    (
        schedule_id,
        workspace_id,
        name,
        cron,
        interval_seconds,
        enqueue,
        missed,
        overlap,
        paused,
        grant,
        created_at,
        anchor,
        next_fire_at,
        last_fired_at,
        last_request_id,
        skipped,
    ) = row
    spec = ScheduleSpec(
        workspace_id=workspace_id,
        name=name,
        enqueue=json.loads(enqueue),
        cron=cron,
        interval_seconds=interval_seconds,
        missed=missed,
        overlap=overlap,
        paused=bool(paused),
        enqueue_grant=None if grant is None else json.loads(grant),
    )
    return Schedule(
        schedule_id=schedule_id,
        spec=spec,
        created_at=created_at,
        anchor=anchor,
        next_fire_at=next_fire_at,
        last_fired_at=last_fired_at,
        last_request_id=last_request_id,
        skipped=skipped,
    )


def _select(conn: sqlite3.Connection, where: str, args: tuple[Any, ...]) -> list[Schedule]:
    rows = conn.execute(f"SELECT {_COLUMNS} FROM {TABLE} WHERE {where}", args).fetchall()
    return [_row(row) for row in rows]


class SQLiteScheduleStore(ScheduleStore):
    """`ScheduleStore` on a `SQLiteDatabase` whose schema includes `create_schema`."""

    def __init__(self, db: SQLiteDatabase) -> None:
        self._db = db

    async def clock(self) -> float:
        """This process's wall clock: only one process serves an embedded file."""
        return time.time()

    async def add(self, spec: ScheduleSpec, schedule_id: str, now: float) -> Schedule:
        anchor = anchor_for(now)
        next_fire_at = None if spec.paused else first_slot(spec, anchor, now)
        schedule = Schedule(schedule_id, spec, now, anchor, next_fire_at)

        def job(tx: Transaction) -> Schedule:
            inserted = tx.execute(
                f"INSERT INTO {TABLE} ({_COLUMNS}) VALUES "
                "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL, 0) "
                "ON CONFLICT (workspace_id, name) DO NOTHING",
                (
                    schedule_id,
                    spec.workspace_id,
                    spec.name,
                    spec.cron,
                    spec.interval_seconds,
                    json.dumps(dict(spec.enqueue)),
                    spec.missed,
                    spec.overlap,
                    int(spec.paused),
                    None if spec.enqueue_grant is None else json.dumps(spec.enqueue_grant),
                    now,
                    anchor,
                    next_fire_at,
                ),
            ).rowcount
            if inserted != 1:
                raise ScheduleExists(f"schedule {spec.name!r} already exists")
            return schedule

        return await self._db.write(job)

    async def get(self, workspace_id: str, name: str) -> Schedule | None:
        def read(conn: sqlite3.Connection) -> Schedule | None:
            found = _select(conn, "workspace_id = ? AND name = ?", (workspace_id, name))
            return found[0] if found else None

        return await self._db.read(read)

    async def list(
        self, workspace_id: str, *, after: str | None = None, limit: int = 100
    ) -> builtins.list[Schedule]:
        def read(conn: sqlite3.Connection) -> builtins.list[Schedule]:
            return _select(
                conn,
                "workspace_id = ? AND name > ? ORDER BY name LIMIT ?",
                (workspace_id, after or "", limit),
            )

        return await self._db.read(read)

    async def delete(self, workspace_id: str, name: str) -> bool:
        def job(tx: Transaction) -> bool:
            deleted = tx.execute(
                f"DELETE FROM {TABLE} WHERE workspace_id = ? AND name = ?", (workspace_id, name)
            )
            return deleted.rowcount == 1

        return await self._db.write(job)

    async def set_paused(self, workspace_id: str, name: str, paused: bool, now: float) -> Schedule:
        def job(tx: Transaction) -> Schedule:
            found = _select(tx.conn, "workspace_id = ? AND name = ?", (workspace_id, name))
            if not found:
                raise ScheduleNotFound(f"no schedule {name!r}")
            schedule = found[0]
            if schedule.spec.paused == paused:
                return schedule
            next_fire_at = None if paused else first_slot(schedule.spec, schedule.anchor, now)
            tx.execute(
                f"UPDATE {TABLE} SET paused = ?, next_fire_at = ? WHERE schedule_id = ?",
                (int(paused), next_fire_at, schedule.schedule_id),
            )
            return _select(tx.conn, "schedule_id = ?", (schedule.schedule_id,))[0]

        return await self._db.write(job)

    async def due(self, now: float, *, limit: int) -> builtins.list[Schedule]:
        def read(conn: sqlite3.Connection) -> builtins.list[Schedule]:
            return _select(
                conn,
                "next_fire_at IS NOT NULL AND next_fire_at <= ? ORDER BY next_fire_at LIMIT ?",
                (now, limit),
            )

        return await self._db.read(read)

    async def next_due_at(self) -> float | None:
        def read(conn: sqlite3.Connection) -> float | None:
            value = conn.execute(
                f"SELECT min(next_fire_at) FROM {TABLE} WHERE next_fire_at IS NOT NULL"
            ).fetchone()[0]
            return None if value is None else float(value)

        return await self._db.read(read)

    async def advance(
        self,
        workspace_id: str,
        schedule_id: str,
        *,
        expected: float,
        next_fire_at: float,
        fired: tuple[float, str] | None,
        skipped: int,
    ) -> bool:
        slot, request_id = fired if fired is not None else (None, None)

        def job(tx: Transaction) -> bool:
            moved = tx.execute(
                f"UPDATE {TABLE} SET next_fire_at = ?, skipped = skipped + ?,"
                " last_fired_at = coalesce(?, last_fired_at),"
                " last_request_id = coalesce(?, last_request_id)"
                " WHERE schedule_id = ? AND workspace_id = ? AND next_fire_at = ? AND paused = 0",
                (next_fire_at, skipped, slot, request_id, schedule_id, workspace_id, expected),
            )
            return moved.rowcount == 1

        return await self._db.write(job)

    async def record_firing(
        self, workspace_id: str, schedule_id: str, slot: float, request_id: str
    ) -> None:
        def job(tx: Transaction) -> None:
            tx.execute(
                f"UPDATE {TABLE} SET last_fired_at = ?, last_request_id = ?"
                " WHERE schedule_id = ? AND workspace_id = ?"
                " AND (last_fired_at IS NULL OR last_fired_at <= ?)",
                (slot, request_id, schedule_id, workspace_id, slot),
            )

        await self._db.write(job)

    async def hold_lease(self, name: str, owner: str, ttl: float, now: float) -> Lease:
        check_lease_ttl(ttl)

        def job(tx: Transaction) -> Lease:
            # Ours: renewed, `held_since` kept. Free or lapsed: taken, held from now.
            tx.execute(
                f"INSERT INTO {LEASES} (name, owner, expires_at, held_since) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (name) DO UPDATE SET"
                " held_since = CASE WHEN owner = excluded.owner AND expires_at >= ?"
                " THEN held_since ELSE excluded.held_since END,"
                " owner = excluded.owner, expires_at = excluded.expires_at"
                " WHERE owner = excluded.owner OR expires_at < ?",
                (name, owner, now + ttl, now, now, now),
            )
            row = tx.execute(
                f"SELECT owner, expires_at, held_since FROM {LEASES} WHERE name = ?", (name,)
            ).fetchone()
            return Lease(row[0], row[1], row[2])

        return await self._db.write(job)

    async def release_lease(self, name: str, owner: str) -> bool:
        def job(tx: Transaction) -> bool:
            deleted = tx.execute(
                f"DELETE FROM {LEASES} WHERE name = ? AND owner = ?", (name, owner)
            )
            return deleted.rowcount == 1

        return await self._db.write(job)

    async def close(self) -> None:
        """Nothing to do: the shared database belongs to whoever opened it."""
