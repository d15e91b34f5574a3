"""Idempotency keys on the shared embedded SQLite database (docs/queue.md, docs/postgres.md).

`begin` reads the row and inserts in the same write job. That is not the check-then-act race the
seed warns about: the job runs on the database's single writer thread inside `BEGIN IMMEDIATE`, so
no other writer — thread or process — can act between the read and the insert.

An owner here holds nothing but its row, so `Owned.release` is the default no-op: one process
serves the file, so a dead owner means a dead server, and the restarted one frees every key still
in progress before it serves (`abandon_all_in_progress`). PostgreSQL, where other instances keep
running, needs the owner's session to prove it alive instead (`cv_server.pg.idempotency`).
"""

from __future__ import annotations

import json
import math

import sqlite_utils

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
from cv_server.sqlite.engine import SQLiteDatabase, Transaction

__all__ = ["TABLE", "SQLiteIdempotencyStore", "complete_key", "create_schema"]

TABLE = "idempotency_keys"


def create_schema(db: sqlite_utils.Database) -> None:
    """Create the key table and its expiry index if missing (idempotent)."""
    db.table(TABLE).create(
        {
            "workspace_id": str,
            "key": str,
            "fingerprint": str,
            "state": str,
            "status_code": int,
            "response_body": str,
            "created_at": float,
            "expires_at": float,
        },
        # Scoped to the tenant, never global.
        pk=("workspace_id", "key"),
        not_null={"workspace_id", "key", "fingerprint", "state", "created_at", "expires_at"},
        if_not_exists=True,
    )
    # Delete expired rows on a schedule; the sweep finds them by expiry.
    db.table(TABLE).create_index(["expires_at"], if_not_exists=True)


def complete_key(
    tx: Transaction, workspace_id: str, key: str, fingerprint: str, response: StoredResponse
) -> None:
    """Store `response` under an owned key, inside the caller's write job (so it commits with
    the effect it describes, or not at all). Raises `IdempotencyKeyLost` — rolling back the job —
    if the key is not in progress under `fingerprint`."""
    updated = tx.execute(
        f"UPDATE {TABLE} SET state = 'completed', status_code = ?, response_body = ? "
        "WHERE workspace_id = ? AND key = ? AND fingerprint = ? AND state = 'in_progress'",
        (response.status_code, json.dumps(response.body), workspace_id, key, fingerprint),
    ).rowcount
    if updated != 1:
        raise IdempotencyKeyLost(f"idempotency key {key!r} is no longer in progress")


def _record(row: tuple[str, str, int | None, str | None, float]) -> KeyRecord:
    fingerprint, state, status_code, body, expires_at = row
    if state not in ("in_progress", "completed"):
        raise ValueError(f"unknown idempotency key state {state!r}")
    return KeyRecord(
        fingerprint=fingerprint,
        state="completed" if state == "completed" else "in_progress",
        status_code=status_code,
        body=None if body is None else json.loads(body),
        expires_at=expires_at,
    )


class SQLiteIdempotencyStore(IdempotencyStore):
    """`IdempotencyStore` on a `SQLiteDatabase` whose schema includes `create_schema`.

    `retention` is `ServerConfig.idempotency_retention_seconds` (24 h, docs/configuration.md).
    """

    def __init__(self, db: SQLiteDatabase, *, retention: float) -> None:
        if not (math.isfinite(retention) and retention > 0):
            raise ValueError(f"retention must be a positive finite number: {retention!r}")
        self._db = db
        self._retention = retention

    async def begin(
        self, workspace_id: str, key: str, fingerprint: str, now: float
    ) -> BeginOutcome:
        def job(tx: Transaction) -> BeginOutcome:
            row = tx.execute(
                f"SELECT fingerprint, state, status_code, response_body, expires_at FROM {TABLE} "
                "WHERE workspace_id = ? AND key = ?",
                (workspace_id, key),
            ).fetchone()
            outcome = decide_begin(None if row is None else _record(row), fingerprint, now)
            if isinstance(outcome, Owned):
                # Replaces an expired row the sweep has not reached yet.
                tx.execute(
                    f"INSERT INTO {TABLE} (workspace_id, key, fingerprint, state, status_code, "
                    "response_body, created_at, expires_at) "
                    "VALUES (?, ?, ?, 'in_progress', NULL, NULL, ?, ?) "
                    "ON CONFLICT (workspace_id, key) DO UPDATE SET "
                    "fingerprint = excluded.fingerprint, state = excluded.state, "
                    "status_code = NULL, response_body = NULL, "
                    "created_at = excluded.created_at, expires_at = excluded.expires_at",
                    (workspace_id, key, fingerprint, now, now + self._retention),
                )
            return outcome

        return await self._db.write(job)

    async def finish(
        self, workspace_id: str, key: str, fingerprint: str, response: StoredResponse, now: float
    ) -> None:
        def job(tx: Transaction) -> None:
            complete_key(tx, workspace_id, key, fingerprint, response)

        await self._db.write(job)

    async def abandon(self, workspace_id: str, key: str, now: float) -> bool:
        def job(tx: Transaction) -> bool:
            deleted = tx.execute(
                f"DELETE FROM {TABLE} WHERE workspace_id = ? AND key = ? AND state = 'in_progress'",
                (workspace_id, key),
            ).rowcount
            return deleted == 1

        return await self._db.write(job)

    async def abandon_all_in_progress(self) -> int:
        """Release every key still in progress; return how many. Only for start-up of the one
        process serving the file, when no request can still be running (docs/queue.md: a crashed
        request must not turn honest retries into 24 hours of 409)."""
        return await self._db.write(
            lambda tx: tx.execute(f"DELETE FROM {TABLE} WHERE state = 'in_progress'").rowcount
        )

    async def sweep(self, now: float, *, limit: int | None = None) -> int:
        check_sweep_limit(limit)

        def job(tx: Transaction) -> int:
            return tx.execute(
                f"DELETE FROM {TABLE} WHERE rowid IN "
                f"(SELECT rowid FROM {TABLE} WHERE expires_at <= ? LIMIT ?)",
                (now, -1 if limit is None else limit),
            ).rowcount

        return await self._db.write(job)

    async def close(self) -> None:
        """Nothing to do: the shared database belongs to whoever opened it."""
