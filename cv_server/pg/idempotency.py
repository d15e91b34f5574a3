"""Idempotency keys on PostgreSQL, shared by every server instance (seed 004 §1, DESIGN §9).

`begin` is an upsert: a new key is inserted and an expired one taken over in place, both in one
statement whose row lock settles concurrent first requests (on any instance): exactly one of
them gets a row back and owns the key. The others then read the row with a fresh snapshot and
let the pure `decide_begin` say how it was used. `complete_key` runs inside another store's
transaction (the queue's enqueue), so the stored answer commits with its effect or not at all.

Tables come from `migrations/004_idempotency_keys.sql`.
"""

from __future__ import annotations

import math
from typing import Any, Final

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints

from cv_server.queue.errors import IdempotencyKeyLost
from cv_server.queue.idempotency import (
    BeginOutcome,
    IdempotencyStore,
    KeyRecord,
    Owned,
    StoredResponse,
    check_sweep_limit,
    decide_begin,
)

__all__ = ["TABLE", "PostgresIdempotencyStore", "complete_key"]

TABLE: Final = "idempotency_keys"

#: `begin` reads back a key it did not get; if the owner abandoned it in between, the key is
#: free and the upsert runs again. Each round needs another request to take and drop the key.
_MAX_ROUNDS: Final = 8

_TAKE: Final = f"""
INSERT INTO {TABLE} AS k (workspace_id, key, fingerprint, state, status_code, response_body,
                          created_at, expires_at)
VALUES ($1, $2, $3, 'in_progress', NULL, NULL, $4, $5)
ON CONFLICT (workspace_id, key) DO UPDATE SET
    fingerprint = excluded.fingerprint,
    state = excluded.state,
    status_code = NULL,
    response_body = NULL,
    created_at = excluded.created_at,
    expires_at = excluded.expires_at
WHERE k.expires_at <= $4
RETURNING true
"""
_READ: Final = (
    f"SELECT fingerprint, state, status_code, response_body, expires_at FROM {TABLE}"
    " WHERE workspace_id = $1 AND key = $2"
)
_COMPLETE: Final = f"""
UPDATE {TABLE} SET state = 'completed', status_code = $4, response_body = $5
WHERE workspace_id = $1 AND key = $2 AND fingerprint = $3 AND state = 'in_progress'
"""
_ABANDON: Final = (
    f"DELETE FROM {TABLE} WHERE workspace_id = $1 AND key = $2 AND state = 'in_progress'"
)
_SWEEP: Final = f"""
DELETE FROM {TABLE} k USING (
    SELECT workspace_id, key FROM {TABLE} WHERE expires_at <= $1 LIMIT $2 FOR UPDATE SKIP LOCKED
) dead
WHERE (k.workspace_id, k.key) = (dead.workspace_id, dead.key)
"""


def _record(row: Any) -> KeyRecord:
    state = row["state"]
    if state not in ("in_progress", "completed"):
        raise ValueError(f"unknown idempotency key state {state!r}")
    return KeyRecord(
        fingerprint=row["fingerprint"],
        state="completed" if state == "completed" else "in_progress",
        status_code=row["status_code"],
        body=row["response_body"],
        expires_at=row["expires_at"],
    )


def _deleted(status: str) -> int:
    """The row count of a `DELETE n` command tag."""
    return int(status.rsplit(" ", 1)[1])


async def complete_key(
    conn: asyncpg.Connection,
    workspace_id: str,
    key: str,
    fingerprint: str,
    response: StoredResponse,
) -> None:
    """Store `response` under an owned key, on `conn`'s open transaction (so it commits with the
    effect it describes, or not at all). Raises `IdempotencyKeyLost` — the caller's transaction
    then rolls back — if the key is not in progress under `fingerprint`."""
    status = await conn.execute(
        _COMPLETE, workspace_id, key, fingerprint, response.status_code, response.body
    )
    if status != "UPDATE 1":
        raise IdempotencyKeyLost(f"idempotency key {key!r} is no longer in progress")


class PostgresIdempotencyStore(IdempotencyStore):
    """`IdempotencyStore` on a PostgreSQL pool whose schema has `004_idempotency_keys` applied.

    `retention` is `ServerConfig.idempotency_retention_seconds` (24 h, DESIGN §10).
    """

    def __init__(self, pool: asyncpg.Pool, *, retention: float) -> None:
        if not (math.isfinite(retention) and retention > 0):
            raise ValueError(f"retention must be a positive finite number: {retention!r}")
        self._pool = pool
        self._retention = retention

    async def begin(
        self, workspace_id: str, key: str, fingerprint: str, now: float
    ) -> BeginOutcome:
        async with self._pool.acquire() as conn:
            for _ in range(_MAX_ROUNDS):
                took = await conn.fetchval(
                    _TAKE, workspace_id, key, fingerprint, now, now + self._retention
                )
                if took:
                    return Owned()
                row = await conn.fetchrow(_READ, workspace_id, key)
                outcome = decide_begin(None if row is None else _record(row), fingerprint, now)
                if not isinstance(outcome, Owned):
                    return outcome
                # Owned by the rule but not by us: the key was abandoned (or expired) between
                # the two statements. Take it properly.
        raise RuntimeError(f"idempotency key {key!r} changed hands {_MAX_ROUNDS} times in a row")

    async def finish(
        self, workspace_id: str, key: str, fingerprint: str, response: StoredResponse, now: float
    ) -> None:
        async with self._pool.acquire() as conn:
            await complete_key(conn, workspace_id, key, fingerprint, response)

    async def abandon(self, workspace_id: str, key: str, now: float) -> bool:
        async with self._pool.acquire() as conn:
            return _deleted(await conn.execute(_ABANDON, workspace_id, key)) == 1

    async def sweep(self, now: float, *, limit: int | None = None) -> int:
        check_sweep_limit(limit)
        async with self._pool.acquire() as conn:
            # LIMIT NULL is no limit.
            return _deleted(await conn.execute(_SWEEP, now, limit))

    async def close(self) -> None:
        """Nothing to do: the pool belongs to whoever opened it."""
