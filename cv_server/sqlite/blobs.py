"""Result blobs on the shared embedded SQLite database (docs/queue.md, docs/postgres.md)."""

from __future__ import annotations

import math
import secrets
import sqlite3
from collections.abc import Callable

import sqlite_utils

from cv_server.queue.blobs import BlobStore, new_blob_ref
from cv_server.queue.idempotency import check_sweep_limit
from cv_server.sqlite.engine import SQLiteDatabase, Transaction

__all__ = ["TABLE", "SQLiteBlobStore", "create_schema"]

TABLE = "request_blobs"


def create_schema(db: sqlite_utils.Database) -> None:
    """Create the blob table and its expiry index if missing (idempotent)."""
    db.table(TABLE).create(
        {
            "workspace_id": str,
            "blob_ref": str,
            "data": bytes,
            "size": int,
            "created_at": float,
            "expires_at": float,
        },
        pk=("workspace_id", "blob_ref"),
        not_null={"workspace_id", "blob_ref", "data", "size", "created_at", "expires_at"},
        if_not_exists=True,
    )
    # The sweep finds expired blobs by expiry (reaped on a schedule).
    db.table(TABLE).create_index(["expires_at"], if_not_exists=True)


def _random_ref() -> str:
    return new_blob_ref(secrets.token_hex(20))


class SQLiteBlobStore(BlobStore):
    """`BlobStore` on a `SQLiteDatabase` whose schema includes `create_schema`.

    `retention` is `ServerConfig.blob_retention_seconds` (24 h, docs/configuration.md).
    """

    def __init__(
        self,
        db: SQLiteDatabase,
        *,
        retention: float,
        new_ref: Callable[[], str] = _random_ref,
    ) -> None:
        if not (math.isfinite(retention) and retention > 0):
            raise ValueError(f"retention must be a positive finite number: {retention!r}")
        self._db = db
        self._retention = retention
        self._new_ref = new_ref

    async def put(self, workspace_id: str, data: bytes, now: float) -> str:
        blob_ref = self._new_ref()
        payload = bytes(data)

        def job(tx: Transaction) -> None:
            tx.execute(
                f"INSERT INTO {TABLE} (workspace_id, blob_ref, data, size, created_at, expires_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (workspace_id, blob_ref, payload, len(payload), now, now + self._retention),
            )

        await self._db.write(job)
        return blob_ref

    async def get(self, workspace_id: str, blob_ref: str, now: float) -> bytes | None:
        def read(conn: sqlite3.Connection) -> bytes | None:
            row = conn.execute(
                f"SELECT data FROM {TABLE} "
                "WHERE workspace_id = ? AND blob_ref = ? AND expires_at > ?",
                (workspace_id, blob_ref, now),
            ).fetchone()
            return None if row is None else bytes(row[0])

        return await self._db.read(read)

    async def size(self, workspace_id: str, blob_ref: str, now: float) -> int | None:
        def read(conn: sqlite3.Connection) -> int | None:
            row = conn.execute(
                f"SELECT size FROM {TABLE} "
                "WHERE workspace_id = ? AND blob_ref = ? AND expires_at > ?",
                (workspace_id, blob_ref, now),
            ).fetchone()
            return None if row is None else int(row[0])

        return await self._db.read(read)

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
