"""Opening every store of the embedded server on one SQLite file (the default backend).

One file, one writer thread (`engine.py`), the schema created or checked at open and stamped in
`PRAGMA user_version`, the token secret read from (or created in) `server_meta`. One server per
file: `cv-server serve` holds `hold_serving_lock` while it serves. `sqlite3` errors at opening
are raised as the seam's `DatabaseUnusable`, with SQLite's own message, so no caller imports
the driver to report them (pinned by
`test_a_corrupted_database_file_is_refused_in_one_line_by_serve_and_token`).
"""

from __future__ import annotations

import functools
import logging
import os
import sqlite3
from pathlib import Path
from typing import IO, Final

import sqlite_utils

from cv_server.config import ServerConfig
from cv_server.sqlite import blobs as blobs_sqlite
from cv_server.sqlite import idempotency as idempotency_sqlite
from cv_server.sqlite import locks as locks_sqlite
from cv_server.sqlite import meta
from cv_server.sqlite import oplog as oplog_sqlite
from cv_server.sqlite import queue as queue_sqlite
from cv_server.sqlite import revocations as revocations_sqlite
from cv_server.sqlite import schedules as schedules_sqlite
from cv_server.sqlite.engine import SQLiteDatabase
from cv_server.storage_faults import StorageUnavailable
from cv_server.stores import DatabaseUnusable, Stores, translating

__all__ = [
    "SQLITE_SCHEMA_VERSION",
    "hold_serving_lock",
    "open_sqlite_database",
    "open_sqlite_stores",
    "set_up_sqlite_database",
]

log = logging.getLogger(__name__)

#: The SQLite schema this code creates, stamped in the file's `PRAGMA user_version`.
SQLITE_SCHEMA_VERSION: Final = 1

#: The opening verbs' `sqlite3.Error`, as `DatabaseUnusable` (SQLite's message kept).
_driver_errors_translated = translating(sqlite3.Error, DatabaseUnusable)


def _sqlite_schema(db: sqlite_utils.Database) -> None:
    # A file a newer cv-server wrote may hold tables or constraints this code does not know:
    # refuse it at start rather than fail (or write rows it cannot read back) mid-traffic.
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    if version > SQLITE_SCHEMA_VERSION:
        raise DatabaseUnusable(
            f"schema version {version} is newer than this cv-server's"
            f" ({SQLITE_SCHEMA_VERSION}): upgrade cv-server to serve this file"
        )
    meta.create_schema(db)
    oplog_sqlite.create_schema(db)
    queue_sqlite.create_schema(db)
    idempotency_sqlite.create_schema(db)
    blobs_sqlite.create_schema(db)
    locks_sqlite.create_schema(db)
    revocations_sqlite.create_schema(db)
    schedules_sqlite.create_schema(db)
    if version < SQLITE_SCHEMA_VERSION:  # in the schema's transaction: stamped with the tables
        db.execute(f"PRAGMA user_version = {SQLITE_SCHEMA_VERSION}")


def hold_serving_lock(db_path: Path) -> IO[str] | None:
    """Take the exclusive lock that makes this process the only server of `db_path`, or raise
    `DatabaseUnusable`; keep the returned file open while serving. The kernel drops the lock
    when the process dies, SIGKILL included. `cv-server serve` takes it; `open_sqlite_stores`
    does not, so tests may still run two apps on one file in one process (the races contract
    does).

    Why: the op-log store caches each sub-doc's head on its writer thread, and the queue's
    start-up repair (`abandon_all_in_progress`) assumes nothing else runs. A second server on
    the same file would make the first answer 500 on every write to a sub-doc the second wrote
    (its cached clock is behind the disk) and serve stale state. A sidecar file, not the
    database: flock on the database could clash with SQLite's own POSIX locks (on NFS flock is
    emulated with them). `cv-server token` does not take it, so tokens can be minted while the
    server runs.
    """
    if str(db_path) == ":memory:":
        return None
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no flock; one server per file is on you
        return None
    db_path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = Path(f"{db_path}.lock")
    file = lock_path.open("a+")
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = file.read().strip() or "?"
        file.close()
        raise DatabaseUnusable(
            f"{db_path} is already served by another cv-server process (pid {holder};"
            f" lock {lock_path}): one server per SQLite file, use PostgreSQL to scale out"
        ) from None
    file.truncate(0)
    file.write(f"{os.getpid()}\n")
    file.flush()
    return file


@_driver_errors_translated
async def open_sqlite_database(path: str) -> SQLiteDatabase:
    """The database at `path`, created if needed, its schema created or checked."""
    return await SQLiteDatabase.open(path, schema=_sqlite_schema)


@_driver_errors_translated
async def set_up_sqlite_database(path: Path) -> None:
    """Create the database at `path` and its token secret unless it has them, as `serve` does
    at start, without serving (`cv-server init`). Idempotent."""
    db = await open_sqlite_database(str(path))
    try:
        await meta.sqlite_token_secret(db)
    finally:
        await db.close()


async def _start_up_writes(
    db: SQLiteDatabase,
    idempotency: idempotency_sqlite.SQLiteIdempotencyStore,
    config: ServerConfig,
) -> bytes:
    """The writes of a start, and the token secret. On a file the storage refuses writes to
    (read-only, full) the server still starts and serves reads, its writes answered 503
    `storage_unavailable` until the file takes them (docs/operating.md, "Storage faults"); only
    a file with no secret yet, which cannot be given one, is refused."""
    # The embedded server is the only process serving its file (`cv-server serve` holds
    # `hold_serving_lock`): at start nothing is running.
    try:
        await idempotency.abandon_all_in_progress()
    except StorageUnavailable as fault:
        log.warning("%s: keys left in progress by the last run stay so: %s", db.path, fault)
    if config.token_secret is not None:
        return config.token_secret
    try:
        return await meta.sqlite_token_secret(db)
    except StorageUnavailable as fault:
        stored = await meta.stored_sqlite_token_secret(db)
        if stored is None:
            raise DatabaseUnusable(
                f"{db.path} has no token secret and cannot get one: {fault}"
            ) from fault
        return stored


@_driver_errors_translated
async def open_sqlite_stores(config: ServerConfig) -> Stores:
    """Every store of the embedded server, on the one file `config.db_path`."""
    if config.db_path is None:
        raise ValueError("ServerConfig.db_path is required for the SQLite backend")
    db = await open_sqlite_database(str(config.db_path))
    queue = queue_sqlite.SQLiteQueueStore(db)
    oplog = oplog_sqlite.SQLiteOpLogStore(
        db,
        snapshot_every=config.snapshot_every,
        cache_limit=config.subdoc_cache_limit,
        retention_seconds=config.oplog_retention_seconds,
        skew_seconds=config.minted_at_skew_seconds,
        queue=queue,  # an apply's `enqueue` commits with its ops (docs/queue.md)
    )
    idempotency = idempotency_sqlite.SQLiteIdempotencyStore(
        db, retention=config.idempotency_retention_seconds
    )
    blobs = blobs_sqlite.SQLiteBlobStore(db, retention=config.blob_retention_seconds)
    locks = locks_sqlite.SQLiteComputeLockStore(db)
    try:
        secret = await _start_up_writes(db, idempotency, config)
    except BaseException:
        await db.close()
        raise
    return Stores(
        faults=db.faults,
        probe_write=functools.partial(meta.probe_write, db),
        oplog=oplog,
        queue=queue,
        idempotency=idempotency,
        blobs=blobs,
        locks=locks,
        revocations=revocations_sqlite.SQLiteRevocationStore(db),
        schedules=schedules_sqlite.SQLiteScheduleStore(db),
        secret=secret,
        reclaim_space=db.incremental_vacuum,
        # Closed in reverse: the stores first (finishing queued writes), the database last.
        _closers=[db.close, locks.close, blobs.close, idempotency.close, queue.close, oplog.close],
    )
