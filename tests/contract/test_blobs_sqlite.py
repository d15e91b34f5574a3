"""The result-blob contract on the embedded SQLite backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from cv_server.queue import BlobStore
from cv_server.sqlite.blobs import SQLiteBlobStore, create_schema
from cv_server.sqlite.engine import SQLiteDatabase
from tests.contract.blobs_contract import RETENTION, BlobsContract, NewStore


class TestSQLiteBlobStore(BlobsContract):
    @pytest.fixture
    async def database(self, tmp_path: Path) -> AsyncIterator[SQLiteDatabase]:
        db = await SQLiteDatabase.open(tmp_path / "blobs.db", schema=create_schema)
        yield db
        await db.close()

    @pytest.fixture
    async def store(self, database: SQLiteDatabase) -> AsyncIterator[BlobStore]:
        store = SQLiteBlobStore(database, retention=RETENTION)
        yield store
        await store.close()

    @pytest.fixture
    async def new_store(self, database: SQLiteDatabase) -> AsyncIterator[NewStore]:
        opened: list[SQLiteBlobStore] = []

        def new_store(**kwargs: Any) -> BlobStore:
            opened.append(SQLiteBlobStore(database, **kwargs))
            return opened[-1]

        yield new_store
        for store in opened:
            await store.close()
