"""Opening the stores a server needs, on SQLite (embedded default) or PostgreSQL (scale-out)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import sqlite_utils

from cv_server import meta
from cv_server.config import ServerConfig
from cv_server.oplog import OpLogStore
from cv_server.oplog import sqlite as oplog_sqlite
from cv_server.sqlite_db import SQLiteDatabase

__all__ = ["Stores", "open_sqlite_database", "open_stores"]


@dataclass
class Stores:
    oplog: OpLogStore
    secret: bytes
    _closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    async def close(self) -> None:
        for close in reversed(self._closers):
            await close()


def _sqlite_schema(db: sqlite_utils.Database) -> None:
    meta.create_schema(db)
    oplog_sqlite.create_schema(db)


async def open_sqlite_database(path: str) -> SQLiteDatabase:
    return await SQLiteDatabase.open(path, schema=_sqlite_schema)


async def open_stores(config: ServerConfig) -> Stores:
    if config.database_url:
        raise NotImplementedError("the PostgreSQL backend is not wired yet")
    if config.db_path is None:
        raise ValueError("ServerConfig needs db_path (SQLite) or database_url (PostgreSQL)")
    db = await open_sqlite_database(str(config.db_path))
    oplog = oplog_sqlite.SQLiteOpLogStore(db, snapshot_every=config.snapshot_every)
    secret = config.token_secret or await meta.sqlite_token_secret(db)
    return Stores(oplog=oplog, secret=secret, _closers=[db.close, oplog.close])
