"""The compute-lock contract on PostgreSQL (each test in a fresh schema), plus what only a shared
database shows: instances on separate pools contend through the database alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.locks import Acquired, ComputeLockStore, Locked
from cv_server.pg import create_pool
from cv_server.pg.locks import TABLE, PostgresComputeLockStore
from tests.contract.locks_contract import LocksContract
from tests.pg.helpers import settings_for

pytestmark = pytest.mark.postgres


class TestPostgresComputeLockStore(LocksContract):
    @pytest.fixture
    async def store(self, pool: asyncpg.Pool) -> AsyncIterator[ComputeLockStore]:
        store = PostgresComputeLockStore(pool)
        yield store
        await store.close()


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


async def test_the_sweep_of_other_keys_is_bounded_per_acquisition(pool: asyncpg.Pool) -> None:
    store = PostgresComputeLockStore(pool, sweep_limit=3)
    for i in range(10):
        assert isinstance(await store.acquire("ws", "job", f"dead-{i}", "w", 1.0, 0.0), Acquired)
    assert await count_rows(pool) == 10
    assert isinstance(await store.acquire("ws", "job", "new", "w", 60.0, 5.0), Acquired)
    assert await count_rows(pool) == 10 - 3 + 1
    for i in range(3):
        await store.acquire("ws", "job", f"new-{i}", "w", 60.0, 5.0)
    assert await count_rows(pool) == 1 + 3


async def test_a_dead_lock_is_taken_over_in_place_even_when_sweeping_is_off(
    pool: asyncpg.Pool,
) -> None:
    store = PostgresComputeLockStore(pool, sweep_limit=0)
    await store.acquire("ws", "job", "other", "w", 1.0, 0.0)
    old = await store.acquire("ws", "job", "task", "crashed", 1.0, 0.0)
    new = await store.acquire("ws", "job", "task", "bob", 60.0, 1.0)
    assert isinstance(old, Acquired)
    assert isinstance(new, Acquired)
    assert new.token != old.token
    assert await count_rows(pool) == 2


async def test_tokens_come_from_the_injected_minter(pool: asyncpg.Pool) -> None:
    tokens = iter(["t-1", "t-2"])
    store = PostgresComputeLockStore(pool, new_token=lambda: next(tokens))
    assert await store.acquire("ws", "job", "a", "w", 60.0, 0.0) == Acquired("t-1", 60.0)
    assert await store.acquire("ws", "job", "b", "w", 60.0, 0.0) == Acquired("t-2", 60.0)


def test_a_negative_sweep_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="sweep_limit"):
        PostgresComputeLockStore(None, sweep_limit=-1)
