"""The operators' listings on PostgreSQL (each test in a fresh schema)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.locks import ComputeLockStore
from cv_server.oplog import OpLogStore
from cv_server.pg.locks import PostgresComputeLockStore
from cv_server.pg.oplog import PostgresOpLogStore
from tests.contract.listing_contract import LockListingContract, SubDocListingContract
from tests.pg.helpers import settings_for

pytestmark = pytest.mark.postgres


class TestPostgresSubDocListing(SubDocListingContract):
    @pytest.fixture
    async def oplog(self, postgres_url: str, schema: str) -> AsyncIterator[OpLogStore]:
        store = await PostgresOpLogStore.open(
            postgres_url, settings_for(schema), channel=f"cv_oplog_{schema}"
        )
        yield store
        await store.close()


class TestPostgresLockListing(LockListingContract):
    @pytest.fixture
    async def locks(self, pool: asyncpg.Pool) -> AsyncIterator[ComputeLockStore]:
        store = PostgresComputeLockStore(pool)
        yield store
        await store.close()
