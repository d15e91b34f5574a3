"""The idempotency-key contract on the embedded SQLite backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cv_server.queue import IdempotencyStore
from cv_server.queue.idempotency_sqlite import SQLiteIdempotencyStore, create_schema
from cv_server.sqlite_db import SQLiteDatabase
from tests.contract.idempotency_contract import RETENTION, IdempotencyContract


class TestSQLiteIdempotencyStore(IdempotencyContract):
    @pytest.fixture
    async def store(self, tmp_path: Path) -> AsyncIterator[IdempotencyStore]:
        db = await SQLiteDatabase.open(tmp_path / "keys.db", schema=create_schema)
        store = SQLiteIdempotencyStore(db, retention=RETENTION)
        yield store
        await store.close()
        await db.close()


def test_a_retention_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="retention"):
        SQLiteIdempotencyStore(None, retention=0)  # type: ignore[arg-type]
