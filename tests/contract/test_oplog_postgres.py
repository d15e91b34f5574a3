"""The op-log contract on PostgreSQL (each test in a fresh schema)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.oplog import OpLogStore
from cv_server.pg.oplog import PostgresOpLogStore
from cv_server.pg.oplog_sql import OPS_TABLE, SNAPSHOTS_TABLE
from tests.contract.oplog_contract import DOC, WS, LogRows, OpenStore, OpLogContract, Reopen
from tests.pg.helpers import settings_for

pytestmark = pytest.mark.postgres


class TestPostgresOpLogStore(OpLogContract):
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
