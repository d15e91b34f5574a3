"""The compute-lock contract on PostgreSQL (each test in a fresh schema), plus what only a shared
database shows: instances on separate pools contend through the database alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.locks import Acquired, ComputeLockStore, Locked
from cv_server.pg import create_pool
from cv_server.pg.locks import TABLE, PostgresComputeLockStore
from tests.contract.locks_contract import CountRows, LocksContract, NewStore
from tests.pg.helpers import settings_for

pytestmark = pytest.mark.postgres


class TestPostgresComputeLockStore(LocksContract):
    @pytest.fixture
    async def store(self, pool: asyncpg.Pool) -> AsyncIterator[ComputeLockStore]:
        store = PostgresComputeLockStore(pool)
        yield store
        await store.close()

    @pytest.fixture
    async def new_store(self, pool: asyncpg.Pool) -> AsyncIterator[NewStore]:
        opened: list[PostgresComputeLockStore] = []

        def new_store(**kwargs: Any) -> ComputeLockStore:
            opened.append(PostgresComputeLockStore(pool, **kwargs))
            return opened[-1]

        yield new_store
        for store in opened:
            await store.close()

    @pytest.fixture
    def count_rows(self, pool: asyncpg.Pool) -> CountRows:
        async def count() -> int:
            return await count_rows(pool)

        return count


async def count_rows(pool: asyncpg.Pool) -> int:
    return int(await pool.fetchval(f"SELECT count(*) FROM {TABLE}"))


async def test_acquirers_on_separate_pools_get_the_lock_exactly_once(
    postgres_url: str, schema: str, pool: asyncpg.Pool
) -> None:
    other = await create_pool(postgres_url, settings_for(schema))
    try:
        stores = [PostgresComputeLockStore(pool), PostgresComputeLockStore(other)]
        await stores[0].acquire("ws", "job", "task", "crashed", 1.0, 0.0)
        outcomes = await asyncio.gather(
            *(stores[i % 2].acquire("ws", "job", "task", f"w{i}", 60.0, 5.0) for i in range(40))
        )
    finally:
        await other.close()
    winners = [o for o in outcomes if isinstance(o, Acquired)]
    assert len(winners) == 1
    assert {o.holder for o in outcomes if isinstance(o, Locked)} == {
        (await stores[0].get("ws", "job", "task", 5.0) or pytest.fail("no lock")).holder
    }
