"""The result-blob contract on PostgreSQL (each test in a fresh schema)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.pg.blobs import PostgresBlobStore
from cv_server.queue import BlobStore
from tests.contract.blobs_contract import RETENTION, BlobsContract, NewStore

pytestmark = pytest.mark.postgres


class TestPostgresBlobStore(BlobsContract):
    @pytest.fixture
    async def store(self, pool: asyncpg.Pool) -> AsyncIterator[BlobStore]:
        store = PostgresBlobStore(pool, retention=RETENTION)
        yield store
        await store.close()

    @pytest.fixture
    async def new_store(self, pool: asyncpg.Pool) -> AsyncIterator[NewStore]:
        opened: list[PostgresBlobStore] = []

        def new_store(**kwargs: Any) -> BlobStore:
            opened.append(PostgresBlobStore(pool, **kwargs))
            return opened[-1]

        yield new_store
        for store in opened:
            await store.close()
