"""Idempotency keys on PostgreSQL, shared by every server instance (docs/queue.md,
docs/postgres.md).

`begin` is an upsert: a new key is inserted and an expired one taken over in place, both in one
statement whose row lock settles concurrent first requests (on any instance): exactly one of
them gets a row back and owns the key. The others then read the row with a fresh snapshot and
let the pure `decide_begin` say how it was used. `complete_key` runs inside another store's
transaction (the queue's enqueue), so the stored answer commits with its effect or not at all.

"In progress" means "its owner's database session is alive". `begin` commits the in_progress row
on its own, so a row alone cannot tell a running request from one whose instance died (that row
would answer 409 for the whole 24 h retention), and other instances may be running theirs, so
no start-up sweep can free them as SQLite does. Instead the owner takes a session-level advisory
lock on `advisory_lock_key(schema, workspace, key)` *before* it writes the row, on a pooled
connection it keeps until `finish`, `abandon` or `Owned.release`. PostgreSQL ends the session of
a client that vanished, and with it the lock. A retry that finds the key in progress tries the
lock: held, the owner is alive (409 as before); free, the owner is gone, and the retry takes the
key over in place, holding the lock from then on. No timeout is involved (none is
configured), and a 64-bit hash collision can only make a key look busy, never steal it.

Owners hold pool connections, so at most `pool max size - 1` keys are owned at once per store:
each owner needs one more connection for its enqueue, and a pool full of owners would wait on
itself forever. A `begin` past that bound waits for an owner to finish.

Tables come from `migrations/004_idempotency_keys.sql`.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Final

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints

from cv_server.queue.errors import IdempotencyKeyLost
from cv_server.queue.idempotency import (
    BeginOutcome,
    IdempotencyStore,
    InProgress,
    KeyRecord,
    Owned,
    StoredResponse,
    check_sweep_limit,
    decide_begin,
)

__all__ = ["TABLE", "PostgresIdempotencyStore", "advisory_lock_key", "complete_key"]

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
#: Take over a live key whose owner is gone. Conditional, so that of two takers (or a taker and
#: an owner finishing just before it released its lock) only one acts on a row still in progress.
_TAKE_OVER: Final = f"""
UPDATE {TABLE} SET state = 'in_progress'
WHERE workspace_id = $1 AND key = $2 AND fingerprint = $3 AND state = 'in_progress'
  AND expires_at > $4
RETURNING true
"""
_TRY_LOCK: Final = "SELECT pg_try_advisory_lock($1)"
_UNLOCK: Final = "SELECT pg_advisory_unlock($1)"
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


def advisory_lock_key(schema: str, workspace_id: str, key: str) -> int:
    """The signed 64-bit advisory lock an owner of `key` holds (what `pg_try_advisory_lock`
    takes). Advisory locks are database-wide, so the schema is part of it: deployments (or
    tests) in separate schemas of one database never share a key's lock."""
    digest = hashlib.blake2b(b"cv-idempotency-key", digest_size=8)
    for part in (schema, workspace_id, key):
        data = part.encode("utf-8")
        digest.update(f"{len(data)}:".encode("ascii"))  # length-prefixed: no part bleeds over
        digest.update(data)
    return int.from_bytes(digest.digest(), "big", signed=True)


@dataclass(eq=False)
class _Owner:
    """An owned key's connection (holding the advisory lock), until released."""

    conn: asyncpg.Connection
    lock: int
    released: bool = False


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

    `retention` is `ServerConfig.idempotency_retention_seconds` (24 h, docs/configuration.md). The
    pool needs at least two connections: one for an owner's lock, one for its enqueue.
    """

    def __init__(self, pool: asyncpg.Pool, *, retention: float) -> None:
        if not (math.isfinite(retention) and retention > 0):
            raise ValueError(f"retention must be a positive finite number: {retention!r}")
        max_size = pool.get_max_size()
        if max_size < 2:
            raise ValueError(f"the pool needs at least 2 connections, not {max_size}")
        self._pool = pool
        self._retention = retention
        # See the module docstring: one connection is always left for the owners' effects.
        self._slots = asyncio.Semaphore(max_size - 1)
        self._owners: dict[tuple[str, str], _Owner] = {}
        self._schema: str | None = None

    async def begin(
        self, workspace_id: str, key: str, fingerprint: str, now: float
    ) -> BeginOutcome:
        await self._slots.acquire()
        try:
            conn = await self._pool.acquire()
        except BaseException:
            self._slots.release()
            raise
        try:
            lock = await self._lock_key(conn, workspace_id, key)
            outcome = await self._begin_on(conn, lock, workspace_id, key, fingerprint, now)
        except BaseException:
            await self._give_back(conn)
            raise
        if not isinstance(outcome, Owned):
            await self._give_back(conn)
            return outcome
        owner = _Owner(conn, lock)
        stale = self._owners.get((workspace_id, key))
        self._owners[workspace_id, key] = owner
        if stale is not None:
            # An owner of ours whose session died (we hold its lock now): its connection is
            # dead, give it back so the pool replaces it. The new owner is tracked first, so
            # `close` still releases it should this fail.
            await self._release(workspace_id, key, stale)

        async def release() -> None:
            await self._release(workspace_id, key, owner)

        return Owned(release)

    async def _begin_on(
        self,
        conn: asyncpg.Connection,
        lock: int,
        workspace_id: str,
        key: str,
        fingerprint: str,
        now: float,
    ) -> BeginOutcome:
        for _ in range(_MAX_ROUNDS):
            if not await conn.fetchval(_TRY_LOCK, lock):
                # A live session owns the key, or is taking it right now.
                row = await conn.fetchrow(_READ, workspace_id, key)
                outcome = decide_begin(None if row is None else _record(row), fingerprint, now)
                # Free by the row but locked: another request is between its lock and its
                # insert (or its abandon and its unlock).
                return InProgress() if isinstance(outcome, Owned) else outcome
            # The lock is taken before the row is written: an in_progress row is never visible
            # without its owner's lock held.
            took = await conn.fetchval(
                _TAKE, workspace_id, key, fingerprint, now, now + self._retention
            )
            if took:
                return Owned()
            # The row is live. Holding its lock, we know no live session owns it: if it is
            # still in progress, its owner died, and we take it over in place.
            if await conn.fetchval(_TAKE_OVER, workspace_id, key, fingerprint, now):
                return Owned()
            await conn.fetchval(_UNLOCK, lock)
            row = await conn.fetchrow(_READ, workspace_id, key)
            outcome = decide_begin(None if row is None else _record(row), fingerprint, now)
            if not isinstance(outcome, Owned):
                return outcome
            # Owned by the rule but not by us: the key expired (or was swept) between the
            # statements. Take it properly.
        raise RuntimeError(f"idempotency key {key!r} changed hands {_MAX_ROUNDS} times in a row")

    async def _lock_key(self, conn: asyncpg.Connection, workspace_id: str, key: str) -> int:
        if self._schema is None:
            # The schema our unqualified table names resolve to (fixed for the pool's life).
            self._schema = str(await conn.fetchval("SELECT current_schema()"))
        return advisory_lock_key(self._schema, workspace_id, key)

    async def _give_back(self, conn: asyncpg.Connection) -> None:
        """Return a connection to the pool and its slot to the owners' bound. The pool resets a
        returned connection (asyncpg runs `pg_advisory_unlock_all()`), and closes it if it broke,
        so a lock can never outlive its owner's release."""
        try:
            await self._pool.release(conn)
        finally:
            self._slots.release()

    async def _release(self, workspace_id: str, key: str, owner: _Owner) -> None:
        if owner.released:
            return
        owner.released = True
        if self._owners.get((workspace_id, key)) is owner:
            del self._owners[workspace_id, key]
        await self._give_back(owner.conn)

    async def finish(
        self, workspace_id: str, key: str, fingerprint: str, response: StoredResponse, now: float
    ) -> None:
        owner = self._owners.get((workspace_id, key))
        try:
            if owner is not None:
                # On the owner's own connection: it needs no second one from the pool.
                await complete_key(owner.conn, workspace_id, key, fingerprint, response)
            else:
                async with self._pool.acquire() as conn:
                    await complete_key(conn, workspace_id, key, fingerprint, response)
        finally:
            # After the answer committed: a retry then finds it completed, never a free lock on
            # a key still in progress.
            if owner is not None:
                await self._release(workspace_id, key, owner)

    async def abandon(self, workspace_id: str, key: str, now: float) -> bool:
        owner = self._owners.get((workspace_id, key))
        try:
            if owner is not None:
                return _deleted(await owner.conn.execute(_ABANDON, workspace_id, key)) == 1
            async with self._pool.acquire() as conn:
                return _deleted(await conn.execute(_ABANDON, workspace_id, key)) == 1
        finally:
            if owner is not None:
                await self._release(workspace_id, key, owner)

    async def sweep(self, now: float, *, limit: int | None = None) -> int:
        check_sweep_limit(limit)
        async with self._pool.acquire() as conn:
            # LIMIT NULL is no limit.
            return _deleted(await conn.execute(_SWEEP, now, limit))

    async def close(self) -> None:
        """Release the keys still owned (their requests can no longer finish here): a retry
        may take them over. The pool itself belongs to whoever opened it."""
        for (workspace_id, key), owner in list(self._owners.items()):
            await self._release(workspace_id, key, owner)
