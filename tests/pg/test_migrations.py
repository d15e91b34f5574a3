"""Versioned migrations: applied once, in order, even when several instances start together."""

from __future__ import annotations

import asyncio

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.pg import Migration, MigrationError, applied_versions, create_pool, load_migrations
from cv_server.pg import migrate as run_migrations
from tests.pg.helpers import settings_for

pytestmark = pytest.mark.postgres

#: A migration set that counts its own runs: a second run of 002 would add a second row.
COUNTING = [
    Migration(1, "runs", "CREATE TABLE runs (version integer NOT NULL)"),
    Migration(2, "slow", "SELECT pg_sleep(0.1); INSERT INTO runs VALUES (2)"),
    Migration(3, "more", "INSERT INTO runs VALUES (3)"),
]


def test_shipped_migrations_have_unique_ascending_versions_starting_with_the_oplog() -> None:
    migrations = load_migrations()
    versions = [m.version for m in migrations]
    assert versions == sorted(set(versions))
    assert migrations[0].version == 1
    assert migrations[0].name == "oplog"
    assert all(m.sql.strip() for m in migrations)


async def test_migrate_applies_every_shipped_migration_once(pool: asyncpg.Pool) -> None:
    shipped = [m.version for m in load_migrations()]
    assert await run_migrations(pool) == shipped
    assert await run_migrations(pool) == []
    async with pool.acquire() as conn:
        assert await applied_versions(conn) == shipped
        assert await conn.fetchval("SELECT to_regclass('workspace_sub_doc_ops') IS NOT NULL")


async def test_migrators_started_together_apply_each_migration_exactly_once(
    postgres_url: str, schema: str
) -> None:
    pools = [
        await create_pool(postgres_url, settings_for(schema, pool_min_size=1, pool_max_size=1))
        for _ in range(4)
    ]
    try:
        results = await asyncio.gather(*(run_migrations(p, COUNTING) for p in pools))
        applied = sorted(version for result in results for version in result)
        assert applied == [1, 2, 3]
        async with pools[0].acquire() as conn:
            assert await conn.fetchval("SELECT count(*) FROM runs") == 2
            assert await applied_versions(conn) == [1, 2, 3]
    finally:
        for p in pools:
            await p.close()


async def test_a_migration_edited_after_it_was_applied_is_refused(pool: asyncpg.Pool) -> None:
    await run_migrations(pool, COUNTING[:1])
    edited = [Migration(1, "runs", "CREATE TABLE runs (version bigint NOT NULL)")]
    with pytest.raises(MigrationError, match="changed after it was applied"):
        await run_migrations(pool, edited)


async def test_a_failing_migration_applies_nothing_of_its_run(pool: asyncpg.Pool) -> None:
    broken = [*COUNTING[:1], Migration(2, "broken", "INSERT INTO no_such_table VALUES (1)")]
    with pytest.raises(MigrationError, match="002_broken failed") as caught:
        await run_migrations(pool, broken)
    assert caught.value.code == "migration_failed"
    async with pool.acquire() as conn:
        assert await applied_versions(conn) == []
        assert not await conn.fetchval("SELECT to_regclass('runs') IS NOT NULL")
