"""Opening the stores a server needs, on SQLite (embedded default) or PostgreSQL (scale-out)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeAlias

import sqlite_utils

from cv_server import meta
from cv_server.config import ServerConfig
from cv_server.locks import sqlite as locks_sqlite
from cv_server.locks.store import ComputeLockStore
from cv_server.oplog import OpLogStore
from cv_server.oplog import sqlite as oplog_sqlite
from cv_server.queue import (
    BlobStore,
    IdempotencyStore,
    QueueStore,
    blobs_sqlite,
    idempotency_sqlite,
)
from cv_server.queue import sqlite as queue_sqlite
from cv_server.sqlite_db import SQLiteDatabase

__all__ = ["FollowCommits", "Stores", "open_sqlite_database", "open_stores"]

#: `await follow(on_head, on_reconnect)`: from now on, call `on_head(workspace_id, sub_doc,
#: clock)` when any instance commits to a sub-doc, and `on_reconnect()` when such news may have
#: been lost (subscribers then catch up from the log). Only backends shared by several
#: instances have one.
FollowCommits: TypeAlias = Callable[
    [Callable[[str, str, int], None], Callable[[], None]], Awaitable[None]
]


@dataclass
class Stores:
    """Every store of one server, on one backend."""

    oplog: OpLogStore
    queue: QueueStore
    idempotency: IdempotencyStore
    blobs: BlobStore
    locks: ComputeLockStore
    secret: bytes
    follow_commits: FollowCommits | None = None
    _closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    async def close(self) -> None:
        for close in reversed(self._closers):
            await close()


def _sqlite_schema(db: sqlite_utils.Database) -> None:
    meta.create_schema(db)
    oplog_sqlite.create_schema(db)
    queue_sqlite.create_schema(db)
    idempotency_sqlite.create_schema(db)
    blobs_sqlite.create_schema(db)
    locks_sqlite.create_schema(db)


async def open_sqlite_database(path: str) -> SQLiteDatabase:
    return await SQLiteDatabase.open(path, schema=_sqlite_schema)


async def open_stores(config: ServerConfig) -> Stores:
    if config.database_url:
        # Imported here: asyncpg is needed only where PostgreSQL is used (the `postgres` extra).
        from cv_server.pg.stores import open_postgres_stores

        return await open_postgres_stores(config)
    if config.db_path is None:
        raise ValueError("ServerConfig needs db_path (SQLite) or database_url (PostgreSQL)")
    db = await open_sqlite_database(str(config.db_path))
    oplog = oplog_sqlite.SQLiteOpLogStore(
        db, snapshot_every=config.snapshot_every, cache_limit=config.subdoc_cache_limit
    )
    queue = queue_sqlite.SQLiteQueueStore(db)
    idempotency = idempotency_sqlite.SQLiteIdempotencyStore(
        db, retention=config.idempotency_retention_seconds
    )
    blobs = blobs_sqlite.SQLiteBlobStore(db, retention=config.blob_retention_seconds)
    locks = locks_sqlite.SQLiteComputeLockStore(db)
    # The embedded server is the only process serving its file: at start nothing is running.
    await idempotency.abandon_all_in_progress()
    secret = config.token_secret or await meta.sqlite_token_secret(db)
    return Stores(
        oplog=oplog,
        queue=queue,
        idempotency=idempotency,
        blobs=blobs,
        locks=locks,
        secret=secret,
        # Closed in reverse: the stores first (finishing queued writes), the database last.
        _closers=[db.close, locks.close, blobs.close, idempotency.close, queue.close, oplog.close],
    )
