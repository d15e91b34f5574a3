"""The operators' listings on the embedded SQLite backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cv_server.locks import ComputeLockStore
from cv_server.oplog import OpLogStore
from cv_server.sqlite.engine import SQLiteDatabase
from cv_server.sqlite.locks import SQLiteComputeLockStore
from cv_server.sqlite.locks import create_schema as create_locks_schema
from cv_server.sqlite.oplog import SQLiteOpLogStore
from tests.contract.listing_contract import LockListingContract, SubDocListingContract


class TestSQLiteSubDocListing(SubDocListingContract):
    @pytest.fixture
    async def oplog(self, tmp_path: Path) -> AsyncIterator[OpLogStore]:
        store = await SQLiteOpLogStore.open(tmp_path / "oplog.db")
        yield store
        await store.close()


class TestSQLiteLockListing(LockListingContract):
    @pytest.fixture
    async def locks(self, tmp_path: Path) -> AsyncIterator[ComputeLockStore]:
        db = await SQLiteDatabase.open(tmp_path / "locks.db", schema=create_locks_schema)
        store = SQLiteComputeLockStore(db)
        yield store
        await store.close()
        await db.close()
