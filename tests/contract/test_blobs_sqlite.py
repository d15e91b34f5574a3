"""The result-blob contract on the embedded SQLite backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cv_server.queue import BlobStore
from cv_server.sqlite.blobs import SQLiteBlobStore, create_schema
from cv_server.sqlite.engine import SQLiteDatabase
from tests.contract.blobs_contract import RETENTION, WS, BlobsContract


class TestSQLiteBlobStore(BlobsContract):
    @pytest.fixture
    async def store(self, tmp_path: Path) -> AsyncIterator[BlobStore]:
        db = await SQLiteDatabase.open(tmp_path / "blobs.db", schema=create_schema)
        store = SQLiteBlobStore(db, retention=RETENTION)
        yield store
        await store.close()
        await db.close()


async def test_references_come_from_the_injected_minter(tmp_path: Path) -> None:
    refs = iter(["b_1", "b_2"])
    db = await SQLiteDatabase.open(tmp_path / "blobs.db", schema=create_schema)
    try:
        store = SQLiteBlobStore(db, retention=RETENTION, new_ref=lambda: next(refs))
        assert [await store.put(WS, b"a", 1.0), await store.put(WS, b"b", 1.0)] == ["b_1", "b_2"]
    finally:
        await db.close()


def test_a_retention_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="retention"):
        SQLiteBlobStore(None, retention=float("inf"))  # type: ignore[arg-type]
