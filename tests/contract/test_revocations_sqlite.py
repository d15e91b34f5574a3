"""The token-revocation contract on the embedded SQLite backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cv_server.revocations import RevocationStore
from cv_server.sqlite.engine import SQLiteDatabase
from cv_server.sqlite.revocations import SQLiteRevocationStore, create_schema, revoke_in_file
from tests.contract.revocations_contract import A, RevocationsContract


class TestSQLiteRevocationStore(RevocationsContract):
    @pytest.fixture
    async def database(self, tmp_path: Path) -> AsyncIterator[SQLiteDatabase]:
        db = await SQLiteDatabase.open(tmp_path / "revocations.db", schema=create_schema)
        yield db
        await db.close()

    @pytest.fixture
    async def store(self, database: SQLiteDatabase) -> AsyncIterator[RevocationStore]:
        store = SQLiteRevocationStore(database)
        yield store
        await store.close()

    async def test_the_cli_writes_the_file_while_it_is_open_and_the_store_reads_it(
        self, store: RevocationStore, tmp_path: Path
    ) -> None:
        assert revoke_in_file(tmp_path / "revocations.db", A, 1000) is True
        assert revoke_in_file(tmp_path / "revocations.db", A, 1000) is False
        assert [e.token_id for e in await store.revoked_since(0)] == [A]
