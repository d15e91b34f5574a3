"""SQLite gives the space compaction frees back to the file system (docs/operating.md, "Storage
over time"): files are in incremental auto-vacuum mode, new ones from the start, existing ones
converted at open, and a compaction pass or a reaping pass shrinks the file."""

from __future__ import annotations

import contextlib
import logging
import secrets
import sqlite3
import time
from pathlib import Path

import pytest

from cv_mutations import fingerprint, new_op_id, parse_op
from cv_server import ServerConfig
from cv_server.compaction import compact_once
from cv_server.oplog import IncomingOp
from cv_server.queue import Completion, EnqueueAsk, NewRequest, random_request_id
from cv_server.reaper import batches, reap_pass
from cv_server.sqlite.engine import SQLiteDatabase
from cv_server.sqlite.stores import open_sqlite_stores

SECRET = b"space-test-secret-0123456789abcdef"


def auto_vacuum(path: Path) -> int:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return int(conn.execute("PRAGMA auto_vacuum").fetchone()[0])


def checkpointed_size(path: Path) -> int:
    """The database file's size once the WAL is folded into it (where SQLite truncates)."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path.stat().st_size


async def test_a_new_file_is_created_in_incremental_auto_vacuum_mode(tmp_path: Path) -> None:
    db = await SQLiteDatabase.open(tmp_path / "new.db")
    await db.close()
    assert auto_vacuum(tmp_path / "new.db") == 2


async def test_an_existing_file_is_converted_to_incremental_auto_vacuum_at_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "old.db"
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("CREATE TABLE kept (x)")
        conn.execute("INSERT INTO kept VALUES (1)")
    path.chmod(0o600)
    assert auto_vacuum(path) == 0
    with caplog.at_level(logging.INFO, logger="cv_server.sqlite.engine"):
        db = await SQLiteDatabase.open(path)
        assert await db.read(lambda c: c.execute("SELECT x FROM kept").fetchall()) == [(1,)]
        await db.close()
    assert auto_vacuum(path) == 2
    assert "converted" in caplog.text


async def test_a_compaction_pass_gives_the_freed_pages_back_to_the_file_system(
    tmp_path: Path,
) -> None:
    path = tmp_path / "cv.db"
    config = ServerConfig(db_path=path, token_secret=SECRET, snapshot_every=100)
    stores = await open_sqlite_stores(config)
    try:
        pad = "x" * 2000
        for _ in range(30):
            ops = []
            for _ in range(100):
                raw = {
                    "type": "node.update",
                    "node_id": "root",
                    "set": {"pad": pad},
                    "op_id": new_op_id(),
                }
                ops.append(IncomingOp(parse_op(raw), raw, fingerprint(raw)))
            await stores.oplog.append("ws1", "tree", ops)
        full = checkpointed_size(path)
        later = time.time() + config.oplog_retention_seconds + 60
        report = await compact_once(stores, config, now=lambda: later)
        assert report.ops == 2999
        assert report.pages > 0
        shrunk = checkpointed_size(path)
        assert shrunk < full / 4, (full, shrunk)
        assert (await stores.oplog.get_state("ws1", "tree"))[0] == 3000
    finally:
        await stores.close()


async def test_a_reaping_pass_gives_the_freed_pages_back_to_the_file_system(
    tmp_path: Path,
) -> None:
    path = tmp_path / "cv.db"
    retention = 1000.0
    config = ServerConfig(
        db_path=path,
        token_secret=SECRET,
        oplog_retention_seconds=0,  # the op-log kept whole: no compaction pass frees anything
        request_retention_seconds=retention,
    )
    stores = await open_sqlite_stores(config)
    try:
        finished_at = time.time() - 2 * retention
        large = b"y" * (config.blob_threshold_bytes + 1024)
        ids = [random_request_id(secrets.token_hex(20)) for _ in range(60)]
        asks = [EnqueueAsk(NewRequest("ws1", "s", request_id, {"n": 1})) for request_id in ids]
        await stores.queue.enqueue_many(asks, finished_at)
        held = await stores.queue.claim_many("s", "w", 60.0, finished_at, limit=len(ids))
        completions = [
            Completion(
                row.request_id,
                row.claim_token or "",
                blob_ref=await stores.blobs.put("ws1", large, finished_at),
            )
            for row in held
        ]
        await stores.queue.complete_many(completions, finished_at)
        full = checkpointed_size(path)
        report = await reap_pass(stores, config, batches(stores, config))
        assert report.deleted["requests"] == report.deleted["blobs"] == len(ids)
        assert report.pages > 0
        shrunk = checkpointed_size(path)
        assert shrunk < full / 4, (full, shrunk)
    finally:
        await stores.close()
