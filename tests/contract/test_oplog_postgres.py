"""The op-log contract on PostgreSQL (each test in a fresh schema)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_mutations import new_op_id
from cv_server.oplog import Committed, OpLogStore
from cv_server.pg.oplog import PostgresOpLogStore
from cv_server.pg.oplog_sql import OPS_TABLE, SNAPSHOTS_TABLE
from tests.contract.compare_and_set_contract import CompareAndSetContract
from tests.contract.oplog_contract import (
    DOC,
    WS,
    LogRows,
    OpenStore,
    OpLogContract,
    Reopen,
    append_one,
    field_value,
    increment,
)
from tests.pg.helpers import settings_for

pytestmark = pytest.mark.postgres


class TestPostgresOpLogStore(OpLogContract, CompareAndSetContract):
    async def opened(self, postgres_url: str, schema: str, **kwargs: Any) -> PostgresOpLogStore:
        kwargs.setdefault("snapshot_every", self.SNAPSHOT_EVERY)
        kwargs.setdefault("channel", f"cv_oplog_{schema}")
        return await PostgresOpLogStore.open(postgres_url, settings_for(schema), **kwargs)

    @pytest.fixture
    async def store(self, postgres_url: str, schema: str) -> AsyncIterator[OpLogStore]:
        store = await self.opened(postgres_url, schema)
        yield store
        await store.close()

    @pytest.fixture
    async def reopen(self, postgres_url: str, schema: str) -> AsyncIterator[Reopen]:
        opened: list[OpLogStore] = []

        async def reopen(store: OpLogStore) -> OpLogStore:
            await store.close()
            new = await self.opened(postgres_url, schema)
            opened.append(new)
            return new

        yield reopen
        for store in opened:
            await store.close()

    @pytest.fixture
    async def open_store(self, postgres_url: str, schema: str) -> AsyncIterator[OpenStore]:
        opened: list[OpLogStore] = []

        async def open_store(**kwargs: Any) -> OpLogStore:
            kwargs.setdefault("channel", f"cv_oplog_{schema}")
            opened.append(
                await PostgresOpLogStore.open(postgres_url, settings_for(schema), **kwargs)
            )
            return opened[-1]

        yield open_store
        for store in opened:
            await store.close()

    @pytest.fixture
    def log_rows(self, pool: asyncpg.Pool) -> LogRows:
        return PostgresLogRows(pool)


class PostgresLogRows:
    """`LogRows` on the test schema, through the test's own pool (as another instance)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def snapshot_clock(self) -> int | None:
        value = await self.pool.fetchval(
            f"SELECT clock FROM {SNAPSHOTS_TABLE} WHERE workspace_id = $1 AND sub_doc = $2", WS, DOC
        )
        return None if value is None else int(value)

    async def delete_ops(self, where: str) -> None:
        await self.pool.execute(f"DELETE FROM {OPS_TABLE} WHERE {where}")

    async def drop_op_id_records(self) -> None:
        await self.pool.execute("DELETE FROM workspace_sub_doc_op_outcomes")

    def cached_sub_docs(self, store: OpLogStore) -> int:
        assert isinstance(store, PostgresOpLogStore)
        return len(store._lanes)


class TestPostgresCompaction:
    """What only several instances on one database can show about compaction."""

    async def test_two_compactors_at_once_delete_each_row_once_and_never_wait_on_each_other(
        self, postgres_url: str, schema: str, pool: asyncpg.Pool
    ) -> None:
        stores = [
            await PostgresOpLogStore.open(
                postgres_url, settings_for(schema), snapshot_every=4, channel=f"c_{schema}"
            )
            for _ in range(2)
        ]
        try:
            docs = [f"doc{n:02d}" for n in range(40)]
            for doc in docs:
                await stores[0].append(WS, doc, [increment(new_op_id()) for _ in range(8)])
            # 40 sub-docs, snapshots at 8: clocks 1..7 of each may go.
            expected = 40 * 7
            passes = [
                OpLogContract.compact_all(store, time.time() + 60, limit=5) for store in stores
            ]
            began = time.perf_counter()
            deleted = await asyncio.wait_for(asyncio.gather(*passes), timeout=30)
            elapsed = time.perf_counter() - began
            assert sum(map(sum, deleted)) == expected  # each row deleted exactly once
            assert await pool.fetchval(f"SELECT count(*) FROM {OPS_TABLE}") == 40
            for doc in docs:
                assert await stores[1].horizon(WS, doc) == 8
                assert await field_value(stores[1], doc=doc) == 8
            assert elapsed < 10, elapsed
        finally:
            for store in stores:
                await store.close()

    async def test_a_compactor_skips_a_sub_doc_another_holds_instead_of_waiting(
        self, postgres_url: str, schema: str, pool: asyncpg.Pool
    ) -> None:
        store = await PostgresOpLogStore.open(
            postgres_url, settings_for(schema), snapshot_every=4, channel=f"c_{schema}"
        )
        try:
            for doc in ("held", "free"):
                await store.append(WS, doc, [increment(new_op_id()) for _ in range(8)])
            async with pool.acquire() as other, other.transaction():
                # What another compactor holds while it works on "held".
                assert await other.fetchval(
                    "SELECT pg_try_advisory_xact_lock(43301, hashtext($1 || '/' || $2))",
                    WS,
                    "held",
                )
                batch = await asyncio.wait_for(store.compact(time.time() + 60, limit=100), 5)
                assert batch.deleted == 7
                assert await store.horizon(WS, "held") == 1
                assert await store.horizon(WS, "free") == 8
            assert (await store.compact(time.time() + 60, limit=100)).deleted == 7
            assert await store.horizon(WS, "held") == 8
        finally:
            await store.close()

    async def test_a_cache_behind_the_horizon_is_rebuilt_from_the_snapshot(
        self, postgres_url: str, schema: str
    ) -> None:
        async def opened() -> PostgresOpLogStore:
            return await PostgresOpLogStore.open(
                postgres_url, settings_for(schema), snapshot_every=4, channel=f"c_{schema}"
            )

        idle, busy = await opened(), await opened()
        try:
            for _ in range(5):
                await append_one(idle, increment(new_op_id()))
            assert await field_value(idle) == 5  # cached at clock 5
            for _ in range(8):  # clocks 6..13, snapshots at 8 and 12
                await append_one(busy, increment(new_op_id()))
            await OpLogContract.compact_all(busy, time.time() + 60)
            assert await busy.horizon(WS, DOC) == 12
            # The idle instance's cache stands at 5; the log starts at 12.
            assert await append_one(idle, increment()) == Committed(None, 14)
            assert await field_value(idle) == 14
        finally:
            await idle.close()
            await busy.close()


class TestPostgresCompareAndSet:
    """What only several instances on one database can show about `if_clock`: the check is
    decided under the head row lock, so two instances never both commit on one base."""

    async def test_instances_racing_on_one_base_clock_commit_exactly_one_batch(
        self, postgres_url: str, schema: str
    ) -> None:
        stores = [
            await PostgresOpLogStore.open(
                postgres_url, settings_for(schema), snapshot_every=4, channel=f"c_{schema}"
            )
            for _ in range(2)
        ]
        try:
            for base in range(10):  # bounded: 10 rounds of 2 x 4 appends on one base
                appends = [
                    store.append(WS, DOC, [increment(new_op_id())], if_clock=base)
                    for store in stores
                    for _ in range(4)
                ]
                answers = await asyncio.wait_for(asyncio.gather(*appends), timeout=30)
                outcomes = [outcome for found, _ in answers for outcome in found]
                assert sum(type(o) is Committed for o in outcomes) == 1, (base, outcomes)
            assert await field_value(stores[1]) == 10
            assert await stores[0].head(WS, DOC) == 10
        finally:
            for store in stores:
                await store.close()
