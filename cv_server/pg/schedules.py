"""Schedules and the scheduler lease on PostgreSQL, shared by every server instance
(docs/queue.md, "Schedules").

Each verb is one statement, except `set_paused` (resume computes the next due time from the
stored spec: the row is locked, `FOR UPDATE`, read and written in one transaction). `advance` is
a compare-and-set on `next_fire_at`, so of two instances that fired the same due time one moves
the schedule on. `hold_lease` is one upsert whose `WHERE` takes a free, lapsed or own lease
only; concurrent callers queue on the row lock and each re-checks the row as the last one left
it, so one owner holds it at a time. Time is the database server's (`clock`).

Tables come from `migrations/013_schedules.sql`; names are unqualified (see
`pool.PostgresSettings.schema`).
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Mapping
from typing import Any, Final

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints

from cv_server.pg.retry import SerializationRetryPolicy, in_transaction, run_with_retry
from cv_server.schedules.model import Schedule, ScheduleSpec, anchor_for, first_slot
from cv_server.schedules.store import (
    Lease,
    ScheduleExists,
    ScheduleNotFound,
    ScheduleStore,
    check_lease_ttl,
)

__all__ = ["PostgresScheduleStore"]

TABLE: Final = "schedules"
LEASES: Final = "scheduler_leases"

_COLUMNS: Final = (
    "schedule_id, workspace_id, name, cron, interval_seconds, enqueue, missed, overlap,"
    " paused, enqueue_grant, created_at, anchor, next_fire_at, last_fired_at,"
    " last_request_id, skipped"
)

_CLOCK: Final = "SELECT extract(epoch FROM clock_timestamp())::float8"

_ADD: Final = f"""
INSERT INTO {TABLE} ({_COLUMNS})
VALUES ($1, $2, $3, $4, $5, $6::json, $7, $8, $9, $10::json, $11, $12, $13, NULL, NULL, 0)
ON CONFLICT (workspace_id, name) DO NOTHING
RETURNING schedule_id
"""

_ADVANCE: Final = f"""
UPDATE {TABLE} SET next_fire_at = $4, skipped = skipped + $5,
    last_fired_at = coalesce($6, last_fired_at),
    last_request_id = coalesce($7, last_request_id)
WHERE schedule_id = $2 AND workspace_id = $1 AND next_fire_at = $3 AND NOT paused
"""

_RECORD: Final = f"""
UPDATE {TABLE} SET last_fired_at = $3, last_request_id = $4
WHERE schedule_id = $2 AND workspace_id = $1 AND (last_fired_at IS NULL OR last_fired_at <= $3)
"""

# Ours: renewed, `held_since` kept. Free or lapsed: taken, held from now ($4).
_HOLD: Final = f"""
INSERT INTO {LEASES} AS l (name, owner, expires_at, held_since) VALUES ($1, $2, $3, $4)
ON CONFLICT (name) DO UPDATE SET
    held_since = CASE WHEN l.owner = excluded.owner AND l.expires_at >= $4
                 THEN l.held_since ELSE excluded.held_since END,
    owner = excluded.owner,
    expires_at = excluded.expires_at
WHERE l.owner = excluded.owner OR l.expires_at < $4
"""


def _schedule(row: Mapping[str, Any]) -> Schedule:
    grant = row["enqueue_grant"]
    spec = ScheduleSpec(
        workspace_id=row["workspace_id"],
        name=row["name"],
        enqueue=json.loads(row["enqueue"]),
        cron=row["cron"],
        interval_seconds=row["interval_seconds"],
        missed=row["missed"],
        overlap=row["overlap"],
        paused=row["paused"],
        enqueue_grant=None if grant is None else json.loads(grant),
    )
    return Schedule(
        schedule_id=row["schedule_id"],
        spec=spec,
        created_at=row["created_at"],
        anchor=row["anchor"],
        next_fire_at=row["next_fire_at"],
        last_fired_at=row["last_fired_at"],
        last_request_id=row["last_request_id"],
        skipped=row["skipped"],
    )


class PostgresScheduleStore(ScheduleStore):
    """`ScheduleStore` on a PostgreSQL pool whose schema has `013_schedules` applied."""

    def __init__(
        self, pool: asyncpg.Pool, *, retry_policy: SerializationRetryPolicy | None = None
    ) -> None:
        self._pool = pool
        self._retry_policy = retry_policy

    async def clock(self) -> float:
        """The database server's clock: every instance judges the lease and the due times on
        it, whatever its machine's says."""
        async with self._pool.acquire() as conn:
            now: float = await conn.fetchval(_CLOCK)
        return now

    async def add(self, spec: ScheduleSpec, schedule_id: str, now: float) -> Schedule:
        anchor = anchor_for(now)
        next_fire_at = None if spec.paused else first_slot(spec, anchor, now)
        grant = None if spec.enqueue_grant is None else json.dumps(spec.enqueue_grant)
        async with self._pool.acquire() as conn:
            inserted = await conn.fetchval(
                _ADD,
                schedule_id,
                spec.workspace_id,
                spec.name,
                spec.cron,
                spec.interval_seconds,
                json.dumps(dict(spec.enqueue)),
                spec.missed,
                spec.overlap,
                spec.paused,
                grant,
                now,
                anchor,
                next_fire_at,
            )
        if inserted is None:
            raise ScheduleExists(f"schedule {spec.name!r} already exists")
        return Schedule(schedule_id, spec, now, anchor, next_fire_at)

    async def get(self, workspace_id: str, name: str) -> Schedule | None:
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow(
                f"SELECT {_COLUMNS} FROM {TABLE} WHERE workspace_id = $1 AND name = $2",
                workspace_id,
                name,
            )
        return None if row is None else _schedule(row)

    async def list(
        self, workspace_id: str, *, after: str | None = None, limit: int = 100
    ) -> builtins.list[Schedule]:
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(
                f"SELECT {_COLUMNS} FROM {TABLE}"
                ' WHERE workspace_id = $1 AND name COLLATE "C" > $2'
                ' ORDER BY name COLLATE "C" LIMIT $3',
                workspace_id,
                after or "",
                limit,
            )
        return [_schedule(row) for row in rows]

    async def delete(self, workspace_id: str, name: str) -> bool:
        async with self._pool.acquire() as conn:
            status: str = await conn.execute(
                f"DELETE FROM {TABLE} WHERE workspace_id = $1 AND name = $2", workspace_id, name
            )
        return status == "DELETE 1"

    async def set_paused(self, workspace_id: str, name: str, paused: bool, now: float) -> Schedule:
        async def tx(conn: asyncpg.Connection) -> Schedule:
            row = await conn.fetchrow(
                f"SELECT {_COLUMNS} FROM {TABLE} WHERE workspace_id = $1 AND name = $2 FOR UPDATE",
                workspace_id,
                name,
            )
            if row is None:
                raise ScheduleNotFound(f"no schedule {name!r}")
            schedule = _schedule(row)
            if schedule.spec.paused == paused:
                return schedule
            next_fire_at = None if paused else first_slot(schedule.spec, schedule.anchor, now)
            row = await conn.fetchrow(
                f"UPDATE {TABLE} SET paused = $2, next_fire_at = $3 WHERE schedule_id = $1"
                f" RETURNING {_COLUMNS}",
                schedule.schedule_id,
                paused,
                next_fire_at,
            )
            return _schedule(row)

        return await in_transaction(self._pool, tx, policy=self._retry_policy)

    async def due(self, now: float, *, limit: int) -> builtins.list[Schedule]:
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(
                f"SELECT {_COLUMNS} FROM {TABLE}"
                " WHERE next_fire_at IS NOT NULL AND next_fire_at <= $1"
                " ORDER BY next_fire_at LIMIT $2",
                now,
                limit,
            )
        return [_schedule(row) for row in rows]

    async def next_due_at(self) -> float | None:
        async with self._pool.acquire() as conn:
            value = await conn.fetchval(
                f"SELECT min(next_fire_at) FROM {TABLE} WHERE next_fire_at IS NOT NULL"
            )
        return None if value is None else float(value)

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

        async def attempt() -> str:
            async with self._pool.acquire() as conn:
                status: str = await conn.execute(
                    _ADVANCE,
                    workspace_id,
                    schedule_id,
                    expected,
                    next_fire_at,
                    skipped,
                    slot,
                    request_id,
                )
                return status

        return await run_with_retry(attempt, policy=self._retry_policy) == "UPDATE 1"

    async def record_firing(
        self, workspace_id: str, schedule_id: str, slot: float, request_id: str
    ) -> None:
        async with self._pool.acquire() as conn:
            await conn.execute(_RECORD, workspace_id, schedule_id, slot, request_id)

    async def hold_lease(self, name: str, owner: str, ttl: float, now: float) -> Lease:
        check_lease_ttl(ttl)

        async def attempt() -> Lease:
            async with self._pool.acquire() as conn:
                await conn.execute(_HOLD, name, owner, now + ttl, now)
                # A fresh snapshot: it sees whichever caller won the row.
                row = await conn.fetchrow(
                    f"SELECT owner, expires_at, held_since FROM {LEASES} WHERE name = $1", name
                )
            return Lease(row["owner"], row["expires_at"], row["held_since"])

        return await run_with_retry(attempt, policy=self._retry_policy)

    async def release_lease(self, name: str, owner: str) -> bool:
        async with self._pool.acquire() as conn:
            status: str = await conn.execute(
                f"DELETE FROM {LEASES} WHERE name = $1 AND owner = $2", name, owner
            )
        return status == "DELETE 1"

    async def close(self) -> None:
        """Nothing to do: the pool belongs to whoever opened it."""
