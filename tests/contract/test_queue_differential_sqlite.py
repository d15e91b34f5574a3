"""The queue and blob stores on the embedded SQLite backend, step by step against the model."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import sqlite_utils

from cv_server.queue import BlobStore, QueueStore
from cv_server.sqlite import blobs as blobs_sqlite
from cv_server.sqlite import queue as sqlite
from cv_server.sqlite.blobs import SQLiteBlobStore
from cv_server.sqlite.engine import SQLiteDatabase
from cv_server.sqlite.queue import SQLiteQueueStore
from tests.contract.queue_differential import BlobOpener, QueueDifferentialContract, QueueOpener


def schema(db: sqlite_utils.Database) -> None:
    sqlite.create_schema(db)
    blobs_sqlite.create_schema(db)


class TestSQLiteQueueDifferential(QueueDifferentialContract):
    @pytest.fixture
    def open_queue(self, tmp_path: Path) -> QueueOpener:
        files = (tmp_path / f"queue-{n}.db" for n in itertools.count())

        @asynccontextmanager
        async def open_queue() -> AsyncIterator[QueueStore]:
            db = await SQLiteDatabase.open(next(files), schema=schema)
            try:
                yield SQLiteQueueStore(db)
            finally:
                await db.close()

        return open_queue

    @pytest.fixture
    def open_blobs(self, tmp_path: Path) -> BlobOpener:
        files = (tmp_path / f"blobs-{n}.db" for n in itertools.count())

        @asynccontextmanager
        async def open_blobs(
            retention: float, new_ref: Callable[[], str]
        ) -> AsyncIterator[BlobStore]:
            db = await SQLiteDatabase.open(next(files), schema=schema)
            try:
                yield SQLiteBlobStore(db, retention=retention, new_ref=new_ref)
            finally:
                await db.close()

        return open_blobs
