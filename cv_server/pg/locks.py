"""Compute locks on PostgreSQL, shared by every server instance (docs/stages.md, docs/postgres.md).

Each verb is **one statement** (one implicit transaction, one round trip):

- `acquire` is an upsert on the key: `INSERT ... ON CONFLICT DO UPDATE ... WHERE expires_at <=
  now`. A free key is inserted; a dead lock is taken over in place (a fresh token, so its old
  holder can never release it); a live lock is left alone and nothing is returned. Concurrent
  acquirers queue on the key's row lock and each re-checks the expiry on the row as the previous
  one left it, so exactly one of them wins.
- A data-modifying CTE in the same statement deletes a bounded batch of dead locks of *other*
  keys, skipping rows another transaction holds (`SKIP LOCKED`): sweeping never waits, and two
  sweeps never wait on each other.

`clock` reads the database server's clock: the HTTP routes pass it as `now`, so every instance
judges a lock's expiry (and sweeps dead ones) on the same clock, whatever its machine's says.

Tables come from `migrations/003_compute_locks.sql`; names are unqualified (see
`pool.PostgresSettings.schema`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints

from cv_server.locks.store import (
    DEFAULT_SWEEP_LIMIT,
    Acquired,
    AcquireOutcome,
    ComputeLockStore,
    Locked,
    LockInfo,
    check_ttl,
)
from cv_server.pg.retry import SerializationRetryPolicy, run_with_retry
from cv_server.tokens import new_lock_token

__all__ = ["TABLE", "PostgresComputeLockStore"]

TABLE: Final = "compute_locks"

#: A lock released between our failed upsert and our read of its holder leaves the key free:
#: try again. Each retry needs another acquirer to win and release in between, so a handful of
#: rounds is already far-fetched.
_MAX_ROUNDS: Final = 8

_KEY: Final = "workspace_id = $1 AND job_id = $2 AND task = $3"

# $4: now, $5: sweep limit. The key itself is left out: its fate is the main statement's.
_SWEEP_CTE: Final = f"""
swept AS (
    DELETE FROM {TABLE} d
    USING (
        SELECT workspace_id, job_id, task FROM {TABLE}
        WHERE expires_at <= $4 AND NOT ({_KEY})
        LIMIT $5
        FOR UPDATE SKIP LOCKED
    ) dead
    WHERE (d.workspace_id, d.job_id, d.task) = (dead.workspace_id, dead.job_id, dead.task)
)
"""

_ACQUIRE: Final = f"""
WITH {_SWEEP_CTE}
INSERT INTO {TABLE} AS l (workspace_id, job_id, task, holder, token, acquired_at, expires_at)
VALUES ($1, $2, $3, $6, $7, $4, $8)
ON CONFLICT (workspace_id, job_id, task) DO UPDATE SET
    holder = excluded.holder,
    token = excluded.token,
    acquired_at = excluded.acquired_at,
    expires_at = excluded.expires_at
WHERE l.expires_at <= $4
RETURNING l.token
"""

_RELEASE: Final = f"""
WITH {_SWEEP_CTE}
DELETE FROM {TABLE} WHERE {_KEY} AND token = $6
"""

# $1: now, $2: limit. Rows another transaction holds are skipped: the background pass never
# waits on an acquirer, nor two instances' passes on each other.
_SWEEP_DEAD: Final = f"""
DELETE FROM {TABLE} d
USING (
    SELECT workspace_id, job_id, task FROM {TABLE}
    WHERE expires_at <= $1
    LIMIT $2
    FOR UPDATE SKIP LOCKED
) dead
WHERE (d.workspace_id, d.job_id, d.task) = (dead.workspace_id, dead.job_id, dead.task)
"""

#: The database server's clock: the one every instance shares (`ComputeLockStore.clock`).
#: clock_timestamp, not now(): the time of the reading, not of some transaction's start.
_CLOCK: Final = "SELECT extract(epoch FROM clock_timestamp())::float8"

_LIVE: Final = (
    f"SELECT holder, token, acquired_at, expires_at FROM {TABLE} WHERE {_KEY} AND expires_at > $4"
)

# $1 workspace, $2/$3 the key to start after ('' sorts first), $4 now, $5 limit: a range scan of
# the primary key.
_LIST_LIVE: Final = f"""
SELECT job_id, task, holder, token, acquired_at, expires_at FROM {TABLE}
WHERE workspace_id = $1 AND (job_id, task) > ($2, $3) AND expires_at > $4
ORDER BY job_id, task
LIMIT $5
"""


class PostgresComputeLockStore(ComputeLockStore):
    """`ComputeLockStore` on a PostgreSQL pool whose schema has `003_compute_locks` applied."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        sweep_limit: int = DEFAULT_SWEEP_LIMIT,
        new_token: Callable[[], str] = new_lock_token,
        retry_policy: SerializationRetryPolicy | None = None,
    ) -> None:
        super().__init__(sweep_limit=sweep_limit, new_token=new_token)
        self._pool = pool
        self._retry_policy = retry_policy

    async def clock(self) -> float:
        """The database server's clock: several instances (several machines) share this store,
        and a lock must lapse at the same moment for all of them."""
        async with self._pool.acquire() as conn:
            now: float = await conn.fetchval(_CLOCK)
        return now

    async def acquire(
        self, workspace_id: str, job_id: str, task: str, holder: str, ttl: float, now: float
    ) -> AcquireOutcome:
        check_ttl(ttl)
        key = (workspace_id, job_id, task)
        token = self._new_token()
        expires_at = now + ttl

        async def attempt() -> AcquireOutcome | None:
            async with self._pool.acquire() as conn:
                # Two sweeps that each delete the other's dead key while taking over their own
                # can deadlock (40P01): the retry runs the statement again.
                won = await conn.fetchval(
                    _ACQUIRE, *key, now, self._sweep_limit, holder, token, expires_at
                )
                if won is not None:
                    return Acquired(token=token, expires_at=expires_at)
                # A fresh snapshot: it sees the holder our upsert waited for.
                row = await conn.fetchrow(_LIVE, *key, now)
            if row is None:
                return None  # released in between: the key is free again
            return Locked(holder=row["holder"], expires_at=row["expires_at"])

        for _ in range(_MAX_ROUNDS):
            outcome = await run_with_retry(attempt, policy=self._retry_policy)
            if outcome is not None:
                return outcome
        raise RuntimeError(f"compute lock {key} changed hands {_MAX_ROUNDS} times in a row")

    async def release(
        self, workspace_id: str, job_id: str, task: str, token: str, now: float
    ) -> bool:
        async def attempt() -> str:
            async with self._pool.acquire() as conn:
                status: str = await conn.execute(
                    _RELEASE, workspace_id, job_id, task, now, self._sweep_limit, token
                )
                return status

        return await run_with_retry(attempt, policy=self._retry_policy) == "DELETE 1"

    async def get(self, workspace_id: str, job_id: str, task: str, now: float) -> LockInfo | None:
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow(_LIVE, workspace_id, job_id, task, now)
        if row is None:
            return None
        return LockInfo(
            workspace_id,
            job_id,
            task,
            row["holder"],
            row["token"],
            row["acquired_at"],
            row["expires_at"],
        )

    async def _list_live(
        self, workspace_id: str, now: float, job_after: str, task_after: str, limit: int
    ) -> list[LockInfo]:
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(_LIST_LIVE, workspace_id, job_after, task_after, now, limit)
        return [
            LockInfo(
                workspace_id,
                row["job_id"],
                row["task"],
                row["holder"],
                row["token"],
                row["acquired_at"],
                row["expires_at"],
            )
            for row in rows
        ]

    async def _sweep_dead(self, now: float, limit: int) -> int:
        async def attempt() -> str:
            async with self._pool.acquire() as conn:
                status: str = await conn.execute(_SWEEP_DEAD, now, limit)
                return status

        return int((await run_with_retry(attempt, policy=self._retry_policy)).rsplit(" ", 1)[1])

    async def close(self) -> None:
        """Nothing to do: the pool belongs to whoever opened it."""
