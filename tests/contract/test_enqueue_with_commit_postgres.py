"""Enqueue with the commit on PostgreSQL (each test in a fresh schema)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.pg.oplog import PostgresOpLogStore
from cv_server.pg.queue import PostgresQueueStore
from tests.contract.enqueue_with_commit_contract import EnqueueWithCommitContract, Linked

pytestmark = pytest.mark.postgres


class TestPostgresEnqueueWithCommit(EnqueueWithCommitContract):
    @pytest.fixture
    async def linked(self, pool: asyncpg.Pool, schema: str) -> AsyncIterator[Linked]:
        queue = PostgresQueueStore(pool, channel=f"cv_queue_{schema}")
        oplog = PostgresOpLogStore(pool, channel=f"cv_oplog_{schema}", queue=queue)
        yield Linked(oplog, queue)
        await oplog.close()
        await queue.close()
