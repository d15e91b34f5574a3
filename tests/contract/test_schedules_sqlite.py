"""The schedule contract on the embedded SQLite backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import sqlite_utils

from cv_server.queue import QueueStore
from cv_server.schedules.store import ScheduleStore
from cv_server.sqlite import queue as queue_sqlite
from cv_server.sqlite import schedules as schedules_sqlite
from cv_server.sqlite.engine import SQLiteDatabase
from cv_server.sqlite.queue import SQLiteQueueStore
from cv_server.sqlite.schedules import SQLiteScheduleStore
from tests.contract.schedules_contract import SchedulesContract


def schema(db: sqlite_utils.Database) -> None:
    queue_sqlite.create_schema(db)
    schedules_sqlite.create_schema(db)


class TestSQLiteScheduleStore(SchedulesContract):
    @pytest.fixture
    def db_path(self, tmp_path: Path) -> Path:
        return tmp_path / "schedules.db"

    @pytest.fixture
    async def database(self, db_path: Path) -> AsyncIterator[SQLiteDatabase]:
        db = await SQLiteDatabase.open(db_path, schema=schema)
        yield db
        await db.close()

    @pytest.fixture
    async def schedules(self, database: SQLiteDatabase) -> AsyncIterator[ScheduleStore]:
        store = SQLiteScheduleStore(database)
        yield store
        await store.close()

    @pytest.fixture
    async def peer_schedules(
        self, schedules: ScheduleStore, db_path: Path
    ) -> AsyncIterator[ScheduleStore]:
        # A second database object on the same file: its own writer connection.
        db = await SQLiteDatabase.open(db_path, schema=schema)
        yield SQLiteScheduleStore(db)
        await db.close()

    @pytest.fixture
    async def queue(self, database: SQLiteDatabase) -> AsyncIterator[QueueStore]:
        store = SQLiteQueueStore(database)
        yield store
        await store.close()
