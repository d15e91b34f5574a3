"""The idempotency-key contract on PostgreSQL (each test in a fresh schema), plus what only a
shared database shows: instances on separate pools settle a key through the database alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.pg import create_pool
from cv_server.pg.idempotency import PostgresIdempotencyStore
from cv_server.queue import IdempotencyStore, InProgress, Owned, Replay, StoredResponse
from tests.contract.idempotency_contract import FP, KEY, RETENTION, WS, IdempotencyContract
from tests.pg.helpers import settings_for

pytestmark = pytest.mark.postgres


class TestPostgresIdempotencyStore(IdempotencyContract):
    @pytest.fixture
    async def store(self, pool: asyncpg.Pool) -> AsyncIterator[IdempotencyStore]:
        store = PostgresIdempotencyStore(pool, retention=RETENTION)
        yield store
        await store.close()


async def test_first_requests_on_separate_pools_own_the_key_exactly_once(
    postgres_url: str, schema: str, pool: asyncpg.Pool
) -> None:
    other = await create_pool(postgres_url, settings_for(schema))
    try:
        stores = [
            PostgresIdempotencyStore(pool, retention=RETENTION),
            PostgresIdempotencyStore(other, retention=RETENTION),
        ]
        outcomes = await asyncio.gather(*(stores[i % 2].begin(WS, KEY, FP, 1.0) for i in range(40)))
        assert outcomes.count(Owned()) == 1
        assert outcomes.count(InProgress()) == 39
        await stores[0].finish(WS, KEY, FP, StoredResponse(202, {"id": "r_1"}), 2.0)
        assert await stores[1].begin(WS, KEY, FP, 3.0) == Replay(202, {"id": "r_1"})
    finally:
        await other.close()


def test_a_retention_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="retention"):
        PostgresIdempotencyStore(None, retention=0)
