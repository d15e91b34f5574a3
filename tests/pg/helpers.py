"""Test isolation on a shared PostgreSQL: every test works in a fresh schema `cv_test_<random>`
and drops it (CASCADE) afterwards, so helpers running PG tests at the same time never collide."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg  # type: ignore[import-untyped]

from cv_server.pg import PostgresSettings

__all__ = ["fresh_schema", "settings_for"]


@asynccontextmanager
async def fresh_schema(dsn: str) -> AsyncIterator[str]:
    """Create an empty schema, yield its name, drop it with everything in it."""
    name = f"cv_test_{secrets.token_hex(6)}"
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f"CREATE SCHEMA {name}")
    finally:
        await conn.close()
    try:
        yield name
    finally:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")
        finally:
            await conn.close()


def settings_for(schema: str, **overrides: Any) -> PostgresSettings:
    """Settings for a test pool: the schema, and few connections (the server is shared)."""
    base = PostgresSettings(schema=schema, pool_min_size=1, pool_max_size=4)
    return dataclasses.replace(base, **overrides)
