"""Token revocations in the embedded SQLite database (cv_server/revocations.py).

`cv-server token revoke` writes the file directly while the server runs (its own connection;
SQLite serialises the writers); the server notices within `revocation_poll_seconds` by reading
the entries past the last sequence number it saw: one index seek per poll.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Final

import sqlite_utils

from cv_server.queue.idempotency import check_sweep_limit
from cv_server.revocations import Revocation, RevocationStore
from cv_server.sqlite.engine import SQLiteDatabase, Transaction
from cv_server.stores import DatabaseUnusable

__all__ = ["TABLE", "SQLiteRevocationStore", "create_schema", "revoke_in_file"]

TABLE: Final = "token_revocations"

_CREATE: Final = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} ("
    " seq INTEGER PRIMARY KEY AUTOINCREMENT,"
    " token_id TEXT NOT NULL UNIQUE,"
    " expires_at INTEGER"
    ")"
)
_INDEX: Final = f"CREATE INDEX IF NOT EXISTS {TABLE}_expires_at ON {TABLE} (expires_at)"
_INSERT: Final = f"INSERT INTO {TABLE} (token_id, expires_at) VALUES (?, ?) ON CONFLICT DO NOTHING"


def create_schema(db: sqlite_utils.Database) -> None:
    """Create the revocation table if missing (idempotent). AUTOINCREMENT: a sequence number is
    never reused after a sweep, so a server that read past it misses no later entry."""
    db.execute(_CREATE)
    db.execute(_INDEX)


def _revoke(conn: sqlite3.Connection, token_id: str, expires_at: int | None) -> bool:
    return conn.execute(_INSERT, (token_id, expires_at)).rowcount == 1


def revoke_in_file(path: Path, token_id: str, expires_at: int | None) -> bool:
    """Revoke `token_id` in the existing database file `path` (`cv-server token revoke`),
    whether or not a server is serving it; False if it already was. The file is opened `mode=rw`:
    a missing one is an error, never a new database. Raises `DatabaseUnusable` (SQLite's
    message kept) for a file SQLite cannot open or write."""
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=rw", uri=True, timeout=30)
        try:
            with conn:
                conn.execute(_CREATE)  # a file served by a cv-server from before revocations
                return _revoke(conn, token_id, expires_at)
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise DatabaseUnusable(str(exc) or type(exc).__name__) from exc


class SQLiteRevocationStore(RevocationStore):
    """`RevocationStore` on a `SQLiteDatabase` whose schema includes `create_schema`."""

    def __init__(self, db: SQLiteDatabase) -> None:
        self._db = db

    async def revoke(self, token_id: str, expires_at: int | None) -> bool:
        return await self._db.write(lambda tx: _revoke_tx(tx, token_id, expires_at))

    async def revoked_since(self, seq: int) -> list[Revocation]:
        def read(conn: sqlite3.Connection) -> list[Revocation]:
            rows = conn.execute(
                f"SELECT seq, token_id, expires_at FROM {TABLE} WHERE seq > ? ORDER BY seq",
                (seq,),
            ).fetchall()
            return [Revocation(int(s), str(t), None if e is None else int(e)) for s, t, e in rows]

        return await self._db.read(read)

    async def sweep(self, now: float, *, limit: int) -> int:
        check_sweep_limit(limit)

        def job(tx: Transaction) -> int:
            return tx.execute(
                f"DELETE FROM {TABLE} WHERE seq IN "
                f"(SELECT seq FROM {TABLE} WHERE expires_at <= ? LIMIT ?)",
                (now, limit),
            ).rowcount

        return await self._db.write(job)


def _revoke_tx(tx: Transaction, token_id: str, expires_at: int | None) -> bool:
    return tx.execute(_INSERT, (token_id, expires_at)).rowcount == 1
