"""The races contract on the embedded SQLite backend. Each peer is a second database object on
the same file (its own writer connection, as a second server process would have): SQLite's file
lock is all that keeps them apart."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import sqlite_utils

from cv_server.config import ServerConfig
from cv_server.locks import ComputeLockStore
from cv_server.queue import QueueStore
from cv_server.sqlite import idempotency as idempotency_sqlite
from cv_server.sqlite import locks as locks_sqlite
from cv_server.sqlite import queue as queue_sqlite
from cv_server.sqlite.engine import SQLiteDatabase
from cv_server.sqlite.locks import SQLiteComputeLockStore
from cv_server.sqlite.queue import SQLiteQueueStore
from tests.contract.races_contract import RacesContract

PEERS = 2


def schema(db: sqlite_utils.Database) -> None:
    queue_sqlite.create_schema(db)
    idempotency_sqlite.create_schema(db)
    locks_sqlite.create_schema(db)


class TestSQLiteRaces(RacesContract):
    @pytest.fixture
    def db_path(self, tmp_path: Path) -> Path:
        return tmp_path / "races.db"

    @pytest.fixture
    async def databases(self, db_path: Path) -> AsyncIterator[list[SQLiteDatabase]]:
        opened = [await SQLiteDatabase.open(db_path, schema=schema) for _ in range(1 + PEERS)]
        yield opened
        for db in opened:
            await db.close()

    @pytest.fixture
    async def store(self, databases: list[SQLiteDatabase]) -> AsyncIterator[QueueStore]:
        yield SQLiteQueueStore(databases[0])  # noqa: PT022 - overrides an async generator

    @pytest.fixture
    async def peer_stores(
        self, store: QueueStore, databases: list[SQLiteDatabase]
    ) -> AsyncIterator[list[QueueStore]]:
        yield [SQLiteQueueStore(db) for db in databases[1:]]  # noqa: PT022 - overrides an async generator

    @pytest.fixture
    async def locks(self, databases: list[SQLiteDatabase]) -> AsyncIterator[ComputeLockStore]:
        yield SQLiteComputeLockStore(databases[0])  # noqa: PT022 - overrides an async generator

    @pytest.fixture
    async def peer_locks(
        self, locks: ComputeLockStore, databases: list[SQLiteDatabase]
    ) -> AsyncIterator[list[ComputeLockStore]]:
        yield [SQLiteComputeLockStore(db) for db in databases[1:]]  # noqa: PT022 - overrides an async generator

    @pytest.fixture
    def make_config(self, tmp_path: Path) -> Callable[..., ServerConfig]:
        def make(**overrides: Any) -> ServerConfig:
            return ServerConfig(**{"db_path": tmp_path / "server.db", **overrides})

        return make
