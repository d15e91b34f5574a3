"""Pooled connections carry the PostgreSQL session guards and the test's schema."""

from __future__ import annotations

import asyncio

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.pg import PostgresSettings, connect, create_pool
from cv_server.pg.pool import close_pool
from tests.pg.helpers import settings_for
from tests.pg.test_broadcast import Relay

pytestmark = pytest.mark.postgres


async def test_pooled_connections_carry_the_design_guards_by_default(
    postgres_url: str, schema: str
) -> None:
    pool = await create_pool(postgres_url, settings_for(schema))
    try:
        async with pool.acquire() as conn:
            assert await conn.fetchval("SHOW statement_timeout") == "5s"
            assert await conn.fetchval("SHOW idle_in_transaction_session_timeout") == "10s"
            assert await conn.fetchval("SELECT current_schema()") == schema
    finally:
        await pool.close()


async def test_a_runaway_statement_is_cancelled_by_the_statement_timeout(
    postgres_url: str, schema: str
) -> None:
    pool = await create_pool(postgres_url, settings_for(schema, statement_timeout_seconds=0.2))
    try:
        async with pool.acquire() as conn:
            with pytest.raises(asyncpg.QueryCanceledError):
                await conn.execute("SELECT pg_sleep(10)")
    finally:
        await pool.close()


async def test_a_transaction_left_idle_is_killed_by_the_server(
    postgres_url: str, schema: str
) -> None:
    settings = settings_for(schema, idle_in_transaction_session_timeout_seconds=0.2)
    conn = await connect(postgres_url, settings)
    killed = asyncio.Event()
    conn.add_termination_listener(lambda _conn: killed.set())
    try:
        transaction = conn.transaction()
        await transaction.start()
        await conn.execute("SELECT 1")
        await asyncio.wait_for(killed.wait(), timeout=5)
        assert conn.is_closed()
        with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError, ConnectionError)):
            await conn.execute("SELECT 1")
    finally:
        conn.terminate()


async def test_json_columns_round_trip_as_python_objects(pool: asyncpg.Pool) -> None:
    value = {"b": [1, 2.5, None, True], "a": {"nested": "é"}}
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT $1::json", value) == value
        assert await conn.fetchval("SELECT $1::jsonb", value) == value


def test_a_schema_name_that_would_need_quoting_is_refused() -> None:
    for bad in ("Public", "a-b", "x; DROP TABLE y", "", "1abc", "a" * 64):
        with pytest.raises(ValueError, match="invalid schema name"):
            PostgresSettings(schema=bad)
    assert PostgresSettings(schema="cv_test_0a1b").schema == "cv_test_0a1b"


async def test_closing_a_pool_whose_connections_went_silent_ends_within_its_bound(
    postgres_url: str, schema: str
) -> None:
    # A failover or a firewall that dropped the flows leaves half-open connections: asyncpg's
    # graceful close waits for answers that never come, and the server's shutdown hung on it.
    relay = Relay(postgres_url)
    try:
        through = await relay.start()
        pool = await create_pool(through, settings_for(schema))
        assert await pool.fetchval("SELECT 1") == 1
        for port in list(relay.links):
            relay.freeze(port)
        loop = asyncio.get_running_loop()
        began = loop.time()
        async with asyncio.timeout(20):  # the old close never returned
            await close_pool(pool, 1.0)
        assert loop.time() - began < 10
        assert pool.is_closing()
    finally:
        await relay.close()
