"""Server-wide settings kept in the database: the token secret (created on first start)."""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

import sqlite_utils

from cv_server.auth import new_secret
from cv_server.sqlite.engine import SQLiteDatabase, Transaction
from cv_server.stores import DatabaseUnusable

__all__ = [
    "create_schema",
    "probe_write",
    "read_sqlite_token_secret",
    "rotate_sqlite_token_secret",
    "sqlite_token_secret",
    "stored_sqlite_token_secret",
]


P = ParamSpec("P")
R = TypeVar("R")


def _driver_errors_translated(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` with `sqlite3.Error` raised as `DatabaseUnusable` (SQLite's message kept): the
    commands that read or rotate a file's secret never import the driver to report it."""

    @functools.wraps(fn)
    def translated(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except sqlite3.Error as exc:
            raise DatabaseUnusable(str(exc) or type(exc).__name__) from exc

    return translated


def create_schema(db: sqlite_utils.Database) -> None:
    db.table("server_meta").create({"key": str, "value": bytes}, pk="key", if_not_exists=True)


async def sqlite_token_secret(db: SQLiteDatabase) -> bytes:
    """The secret stored in the database, created (once, atomically) if there is none."""

    def get_or_create(tx: Transaction) -> bytes:
        tx.execute(
            "INSERT OR IGNORE INTO server_meta (key, value) VALUES ('token_secret', ?)",
            (new_secret(),),
        )
        row = tx.execute("SELECT value FROM server_meta WHERE key = 'token_secret'").fetchone()
        return bytes(row[0])

    return await db.write(get_or_create)


async def probe_write(db: SQLiteDatabase) -> None:
    """One small committed write (a `write_probe` row of its own, which nothing reads): it
    succeeds only while the file takes writes (`/readyz` after a storage fault). Raises
    `StorageUnavailable` when it does not."""

    def probe(tx: Transaction) -> None:
        tx.execute(
            "INSERT OR REPLACE INTO server_meta (key, value) VALUES ('write_probe', ?)",
            (new_secret(),),
        )

    await db.write(probe)


async def stored_sqlite_token_secret(db: SQLiteDatabase) -> bytes | None:
    """The secret stored in the open database, or None: read only, for a server that starts on
    a file it may not write (the secret it would create could not be kept)."""

    def read(conn: sqlite3.Connection) -> bytes | None:
        row = conn.execute("SELECT value FROM server_meta WHERE key = 'token_secret'").fetchone()
        return None if row is None else bytes(row[0])

    return await db.read(read)


@_driver_errors_translated
def read_sqlite_token_secret(path: Path) -> bytes | None:
    """The secret stored in the existing database file `path`, or None when it holds none (not
    a cv-server database, or one no server has started on yet). Raises `DatabaseUnusable` for a
    file SQLite cannot read ("file is not a database").

    For `cv-server token`, which must never create a database or write into one: the file is
    opened read-only (`mode=ro`), so a mistyped `--db` cannot become a new database with a new
    secret, whose tokens no server accepts, and an unrelated SQLite file gets no tables.
    """
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        try:
            row = conn.execute(
                "SELECT value FROM server_meta WHERE key = 'token_secret'"
            ).fetchone()
        except sqlite3.OperationalError as exc:
            if str(exc).startswith("no such table"):
                return None
            raise
    finally:
        conn.close()
    return None if row is None else bytes(row[0])


@_driver_errors_translated
def rotate_sqlite_token_secret(path: Path) -> bool:
    """Replace the secret stored in the existing database file `path` with a new one, in one
    transaction; False (nothing written) when it holds none. Raises `DatabaseUnusable` for a
    file SQLite cannot read or write.

    For `cv-server rotate-secret`, which must never create a database: the file is opened
    `mode=rw` (a missing one is an error, not a new file), and the server's tables are not
    created. The caller makes sure no server is serving the file (it caches the secret).
    """
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=rw", uri=True, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous = FULL")  # as the server writes: durable once it says so
        conn.execute("BEGIN IMMEDIATE")
        try:
            replaced = conn.execute(
                "UPDATE server_meta SET value = ? WHERE key = 'token_secret'", (new_secret(),)
            ).rowcount
        except sqlite3.OperationalError as exc:
            conn.execute("ROLLBACK")
            if str(exc).startswith("no such table"):
                return False
            raise
        conn.execute("COMMIT")
    finally:
        conn.close()
    return replaced == 1
