"""The races contract on PostgreSQL (each test in a fresh schema). Each peer is another instance:
its own pool, so the stores contend through the database alone (SKIP LOCKED, row locks)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.cli import _with_schema
from cv_server.config import ServerConfig
from cv_server.locks import ComputeLockStore
from cv_server.pg import create_pool
from cv_server.pg.locks import PostgresComputeLockStore
from cv_server.pg.queue import PostgresQueueStore
from cv_server.queue import QueueStore
from tests.contract.races_contract import RacesContract
from tests.pg.helpers import settings_for

pytestmark = pytest.mark.postgres

PEERS = 2


class TestPostgresRaces(RacesContract):
    @pytest.fixture
    async def peer_pools(
        self, postgres_url: str, schema: str, pool: asyncpg.Pool
    ) -> AsyncIterator[list[asyncpg.Pool]]:
        pools = [await create_pool(postgres_url, settings_for(schema)) for _ in range(PEERS)]
        yield pools
        for peer in pools:
            await peer.close()

    @pytest.fixture
    async def store(self, pool: asyncpg.Pool, schema: str) -> AsyncIterator[QueueStore]:
        store = PostgresQueueStore(pool, channel=f"cv_queue_{schema}")
        yield store
        await store.close()

    @pytest.fixture
    async def peer_stores(
        self, store: QueueStore, peer_pools: list[asyncpg.Pool], schema: str
    ) -> AsyncIterator[list[QueueStore]]:
        peers = [PostgresQueueStore(p, channel=f"cv_queue_{schema}") for p in peer_pools]
        yield list(peers)
        for peer in peers:
            await peer.close()

    @pytest.fixture
    async def locks(self, pool: asyncpg.Pool) -> AsyncIterator[ComputeLockStore]:
        yield PostgresComputeLockStore(pool)  # noqa: PT022 - overrides an async generator

    @pytest.fixture
    async def peer_locks(
        self, locks: ComputeLockStore, peer_pools: list[asyncpg.Pool]
    ) -> AsyncIterator[list[ComputeLockStore]]:
        yield [PostgresComputeLockStore(p) for p in peer_pools]  # noqa: PT022 - overrides an async generator

    @pytest.fixture
    def make_config(self, postgres_url: str, schema: str) -> Callable[..., ServerConfig]:
        def make(**overrides: Any) -> ServerConfig:
            return ServerConfig(**{"database_url": _with_schema(postgres_url, schema), **overrides})

        return make
