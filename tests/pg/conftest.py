"""Fixtures of the PostgreSQL-specific tests: a fresh schema and a migrated pool in it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.pg import create_pool
from tests.pg.helpers import fresh_schema, settings_for


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
