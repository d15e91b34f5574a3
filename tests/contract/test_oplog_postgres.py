"""The op-log contract on PostgreSQL (each test in a fresh schema)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from cv_server.oplog import OpLogStore
from cv_server.pg.oplog import PostgresOpLogStore
from tests.contract.oplog_contract import OpLogContract, Reopen
from tests.pg.helpers import settings_for

pytestmark = pytest.mark.postgres


class TestPostgresOpLogStore(OpLogContract):
    async def open_store(self, postgres_url: str, schema: str) -> PostgresOpLogStore:
        return await PostgresOpLogStore.open(
            postgres_url,
            settings_for(schema),
            snapshot_every=self.SNAPSHOT_EVERY,
            channel=f"cv_oplog_{schema}",
        )

    @pytest.fixture
    async def store(self, postgres_url: str, schema: str) -> AsyncIterator[OpLogStore]:
        store = await self.open_store(postgres_url, schema)
        yield store
        await store.close()

    @pytest.fixture
    async def reopen(self, postgres_url: str, schema: str) -> AsyncIterator[Reopen]:
        opened: list[OpLogStore] = []

        async def reopen(store: OpLogStore) -> OpLogStore:
            await store.close()
            new = await self.open_store(postgres_url, schema)
            opened.append(new)
            return new

        yield reopen
        for store in opened:
            await store.close()
