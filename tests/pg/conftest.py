"""Fixtures of the PostgreSQL-specific tests: a fresh schema and a migrated pool in it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.pg import create_pool
from cv_server.pg.oplog import PostgresOpLogStore
from tests.pg.helpers import fresh_schema, settings_for

#: `open_store(**kwargs)`: a `PostgresOpLogStore` on the test schema.
Opener = Callable[..., Any]


@pytest.fixture
async def schema(postgres_url: str) -> AsyncIterator[str]:
    async with fresh_schema(postgres_url) as name:
        yield name


@pytest.fixture
async def pool(postgres_url: str, schema: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await create_pool(postgres_url, settings_for(schema))
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
async def open_store(postgres_url: str, schema: str) -> AsyncIterator[Opener]:
    """Opens op-log stores on the test schema, each with its own pool (as separate servers
    would); closed at the end of the test."""
    opened: list[PostgresOpLogStore] = []

    async def open_store(**kwargs: Any) -> PostgresOpLogStore:
        kwargs.setdefault("channel", f"cv_oplog_{schema}")
        store = await PostgresOpLogStore.open(postgres_url, settings_for(schema), **kwargs)
        opened.append(store)
        return store

    yield open_store
    for store in opened:
        await store.close()
