"""Server-wide settings kept in the database: the token secret (created on first start)."""

from __future__ import annotations

import sqlite_utils

from cv_server.auth import new_secret
from cv_server.sqlite_db import SQLiteDatabase, Transaction

__all__ = ["create_schema", "sqlite_token_secret"]


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
