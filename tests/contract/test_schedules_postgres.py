"""The schedule contract on PostgreSQL (each test in a fresh schema); `peer_schedules` is a
second instance's store, on its own pool."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.pg import create_pool
from cv_server.pg.queue import PostgresQueueStore
from cv_server.pg.schedules import PostgresScheduleStore
from cv_server.queue import QueueStore
from cv_server.schedules.store import ScheduleStore
from tests.contract.schedules_contract import SchedulesContract
from tests.pg.helpers import settings_for

pytestmark = pytest.mark.postgres


class TestPostgresScheduleStore(SchedulesContract):
    @pytest.fixture
    async def schedules(self, pool: asyncpg.Pool) -> AsyncIterator[ScheduleStore]:
        store = PostgresScheduleStore(pool)
        yield store
        await store.close()

    @pytest.fixture
    async def peer_schedules(
        self, pool: asyncpg.Pool, postgres_url: str, schema: str
    ) -> AsyncIterator[ScheduleStore]:
        other = await create_pool(postgres_url, settings_for(schema))
        yield PostgresScheduleStore(other)
        await other.close()

    @pytest.fixture
    async def queue(self, pool: asyncpg.Pool, schema: str) -> AsyncIterator[QueueStore]:
        store = PostgresQueueStore(pool, channel=f"cv_queue_{schema}")
        yield store
        await store.close()
