"""The result-blob contract on PostgreSQL (each test in a fresh schema)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.pg.blobs import PostgresBlobStore
from cv_server.queue import BlobStore
from tests.contract.blobs_contract import RETENTION, WS, BlobsContract

pytestmark = pytest.mark.postgres


class TestPostgresBlobStore(BlobsContract):
    @pytest.fixture
    async def store(self, pool: asyncpg.Pool) -> AsyncIterator[BlobStore]:
        store = PostgresBlobStore(pool, retention=RETENTION)
        yield store
        await store.close()


async def test_references_come_from_the_injected_minter(pool: asyncpg.Pool) -> None:
    refs = iter(["b_1", "b_2"])
    store = PostgresBlobStore(pool, retention=RETENTION, new_ref=lambda: next(refs))
    assert [await store.put(WS, b"a", 1.0), await store.put(WS, b"b", 1.0)] == ["b_1", "b_2"]
    assert await store.get(WS, "b_2", 2.0) == b"b"


def test_a_retention_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="retention"):
        PostgresBlobStore(None, retention=float("inf"))
