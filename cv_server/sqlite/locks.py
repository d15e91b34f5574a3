"""Compute locks on the shared embedded SQLite database (docs/stages.md, docs/postgres.md).

Atomicity comes from the database's single writer thread: each `acquire` is one write job (its
own SAVEPOINT inside a group commit), so the delete-dead / sweep / insert-or-ignore sequence of one
acquirer never interleaves with another's, and the primary key settles the rest.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

import sqlite_utils

from cv_server.locks.store import (
    DEFAULT_SWEEP_LIMIT,
    Acquired,
    AcquireOutcome,
    ComputeLockStore,
    Locked,
    LockInfo,
    check_ttl,
)
from cv_server.sqlite.engine import SQLiteDatabase, Transaction
from cv_server.tokens import new_lock_token

__all__ = ["SQLiteComputeLockStore", "create_schema"]

TABLE = "compute_locks"

_KEY = "workspace_id = ? AND job_id = ? AND task = ?"


def create_schema(db: sqlite_utils.Database) -> None:
    """Create the lock table and its expiry index if missing (idempotent)."""
    db.table(TABLE).create(
        {
            "workspace_id": str,
            "job_id": str,
            "task": str,
            "holder": str,
            "token": str,
            "acquired_at": float,
            "expires_at": float,
        },
        pk=("workspace_id", "job_id", "task"),
        not_null={"workspace_id", "job_id", "task", "holder", "token", "acquired_at", "expires_at"},
        if_not_exists=True,
    )
    # The sweep looks for dead rows by expiry, across keys.
    db.table(TABLE).create_index(["expires_at"], if_not_exists=True)


class SQLiteComputeLockStore(ComputeLockStore):
    """`ComputeLockStore` on a `SQLiteDatabase` whose schema includes `create_schema`."""

    def __init__(
        self,
        db: SQLiteDatabase,
        *,
        sweep_limit: int = DEFAULT_SWEEP_LIMIT,
        new_token: Callable[[], str] = new_lock_token,
    ) -> None:
        super().__init__(sweep_limit=sweep_limit, new_token=new_token)
        self._db = db

    async def acquire(
        self, workspace_id: str, job_id: str, task: str, holder: str, ttl: float, now: float
    ) -> AcquireOutcome:
        check_ttl(ttl)
        key = (workspace_id, job_id, task)
        token = self._new_token()
        expires_at = now + ttl

        def job(tx: Transaction) -> AcquireOutcome:
            # Expired locks are cleaned on the next acquisition, so a crashed holder
            # blocks the key for one TTL at most.
            tx.execute(f"DELETE FROM {TABLE} WHERE {_KEY} AND expires_at <= ?", (*key, now))
            self._sweep(tx, now)
            # ON CONFLICT on the key only: unlike INSERT OR IGNORE it cannot hide a NOT NULL error.
            inserted = tx.execute(
                f"INSERT INTO {TABLE} "
                "(workspace_id, job_id, task, holder, token, acquired_at, expires_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (workspace_id, job_id, task) DO NOTHING",
                (*key, holder, token, now, expires_at),
            ).rowcount
            if inserted == 1:
                return Acquired(token=token, expires_at=expires_at)
            row = tx.execute(f"SELECT holder, expires_at FROM {TABLE} WHERE {_KEY}", key).fetchone()
            return Locked(holder=row[0], expires_at=row[1])

        return await self._db.write(job)

    async def release(
        self, workspace_id: str, job_id: str, task: str, token: str, now: float
    ) -> bool:
        key = (workspace_id, job_id, task)

        def job(tx: Transaction) -> bool:
            deleted = tx.execute(f"DELETE FROM {TABLE} WHERE {_KEY} AND token = ?", (*key, token))
            self._sweep(tx, now)
            return deleted.rowcount == 1

        return await self._db.write(job)

    async def get(self, workspace_id: str, job_id: str, task: str, now: float) -> LockInfo | None:
        key = (workspace_id, job_id, task)

        def read(conn: sqlite3.Connection) -> LockInfo | None:
            row = conn.execute(
                f"SELECT holder, token, acquired_at, expires_at FROM {TABLE} "
                f"WHERE {_KEY} AND expires_at > ?",
                (*key, now),
            ).fetchone()
            if row is None:
                return None
            return LockInfo(workspace_id, job_id, task, row[0], row[1], row[2], row[3])

        return await self._db.read(read)

    async def _list_live(
        self, workspace_id: str, now: float, job_after: str, task_after: str, limit: int
    ) -> list[LockInfo]:

        def read(conn: sqlite3.Connection) -> list[LockInfo]:
            # A range of the primary key (workspace_id, job_id, task); '' sorts first.
            rows = conn.execute(
                "SELECT job_id, task, holder, token, acquired_at, expires_at "
                f"FROM {TABLE} WHERE workspace_id = ? AND (job_id, task) > (?, ?) "
                "AND expires_at > ? ORDER BY job_id, task LIMIT ?",
                (workspace_id, job_after, task_after, now, limit),
            ).fetchall()
            return [LockInfo(workspace_id, *row) for row in rows]

        return await self._db.read(read)

    async def _sweep_dead(self, now: float, limit: int) -> int:
        def job(tx: Transaction) -> int:
            return _delete_dead(tx, now, limit)

        return await self._db.write(job)

    async def close(self) -> None:
        """Nothing to do: the shared database belongs to whoever opened it."""

    def _sweep(self, tx: Transaction, now: float) -> None:
        if self._sweep_limit == 0:
            return
        _delete_dead(tx, now, self._sweep_limit)


def _delete_dead(tx: Transaction, now: float, limit: int) -> int:
    """Delete at most `limit` dead locks, by the expiry index; return how many."""
    return tx.execute(
        f"DELETE FROM {TABLE} WHERE rowid IN "
        f"(SELECT rowid FROM {TABLE} WHERE expires_at <= ? LIMIT ?)",
        (now, limit),
    ).rowcount
