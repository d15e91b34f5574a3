"""Fixtures the PostgreSQL subclasses of the contract suites share: a fresh schema per test and a
migrated pool in it. (SQLite subclasses use tmp_path; these are only requested by PostgreSQL.)"""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.pg import create_pool, migrate
from tests.pg.helpers import fresh_schema, settings_for


@pytest.fixture
async def schema(postgres_url: str) -> AsyncIterator[str]:
    async with fresh_schema(postgres_url) as name:
        yield name


@pytest.fixture
async def pool(postgres_url: str, schema: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await create_pool(postgres_url, settings_for(schema))
    try:
        await migrate(pool)
        yield pool
    finally:
        await pool.close()
