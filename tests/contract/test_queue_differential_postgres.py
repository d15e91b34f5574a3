"""The queue and blob stores on PostgreSQL, step by step against the model. One fresh schema
per test; every opened store starts from emptied tables (each Hypothesis example runs in its own
event loop, so each opens its own pool)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.pg import create_pool, migrate
from cv_server.pg.blobs import PostgresBlobStore
from cv_server.pg.queue import PostgresQueueStore
from cv_server.queue import BlobStore, QueueStore
from tests.contract.queue_differential import BlobOpener, QueueDifferentialContract, QueueOpener
from tests.pg.helpers import settings_for

pytestmark = pytest.mark.postgres


def _opener(postgres_url: str, schema: str) -> Callable[[str], AsyncIterator[asyncpg.Pool]]:
    """A pool on `schema`, migrated, with `table` emptied."""
    migrated = False

    async def open_pool(table: str) -> AsyncIterator[asyncpg.Pool]:
        nonlocal migrated
        pool = await create_pool(postgres_url, settings_for(schema, pool_max_size=2))
        try:
            if not migrated:
                await migrate(pool)
                migrated = True
            await pool.execute(f"TRUNCATE {table}")
            yield pool
        finally:
            await pool.close()

    return open_pool


class TestPostgresQueueDifferential(QueueDifferentialContract):
    @pytest.fixture
    def open_queue(self, postgres_url: str, schema: str) -> QueueOpener:
        open_pool = asynccontextmanager(_opener(postgres_url, schema))

        @asynccontextmanager
        async def open_queue() -> AsyncIterator[QueueStore]:
            async with open_pool("workspace_process_requests") as pool:
                store = PostgresQueueStore(pool, channel=f"cv_queue_{schema}")
                try:
                    yield store
                finally:
                    await store.close()

        return open_queue

    @pytest.fixture
    def open_blobs(self, postgres_url: str, schema: str) -> BlobOpener:
        open_pool = asynccontextmanager(_opener(postgres_url, schema))

        @asynccontextmanager
        async def open_blobs(
            retention: float, new_ref: Callable[[], str]
        ) -> AsyncIterator[BlobStore]:
            async with open_pool("request_blobs") as pool:
                yield PostgresBlobStore(pool, retention=retention, new_ref=new_ref)

        return open_blobs
