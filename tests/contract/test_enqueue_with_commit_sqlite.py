"""Enqueue with the commit on the embedded SQLite backend: the op-log and the queue on one file."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import sqlite_utils

from cv_server.sqlite import oplog, queue
from cv_server.sqlite.engine import SQLiteDatabase
from cv_server.sqlite.oplog import SQLiteOpLogStore
from cv_server.sqlite.queue import SQLiteQueueStore
from tests.contract.enqueue_with_commit_contract import EnqueueWithCommitContract, Linked


def _schema(db: sqlite_utils.Database) -> None:
    oplog.create_schema(db)
    queue.create_schema(db)


class TestSQLiteEnqueueWithCommit(EnqueueWithCommitContract):
    @pytest.fixture
    async def linked(self, tmp_path: Path) -> AsyncIterator[Linked]:
        db = await SQLiteDatabase.open(tmp_path / "cv.db", schema=_schema)
        requests = SQLiteQueueStore(db)
        log = SQLiteOpLogStore(db, queue=requests)
        yield Linked(log, requests)
        await log.close()
        await requests.close()
        await db.close()
