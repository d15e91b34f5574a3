"""The result-blob contract (docs/queue.md), written once and run against every backend.

A backend's test class subclasses `BlobsContract` and overrides two fixtures: `store`, built with
`RETENTION` as its retention, and `new_store`, a callable that builds another store of the backend
on the same database from constructor keywords (`retention=`, `new_ref=`), closed at teardown.
Time is passed explicitly: expiry needs no clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from cv_server.config import ServerConfig
from cv_server.queue import BlobStore

RETENTION = ServerConfig().blob_retention_seconds
WS = "ws-1"
OTHER_WS = "ws-2"

#: `new_store(**constructor_keywords)`: another store of the backend on the test's database.
NewStore = Callable[..., BlobStore]


class BlobsContract:
    """Every `BlobStore` keeps these rules."""

    @pytest.fixture
    async def store(self) -> AsyncIterator[BlobStore]:
        raise NotImplementedError("a backend's test class provides the store")
        yield  # noqa: PT022 - an async generator, like the overrides

    @pytest.fixture
    async def new_store(self) -> AsyncIterator[NewStore]:
        raise NotImplementedError("a backend's test class provides new_store")
        yield  # noqa: PT022 - an async generator, like the overrides

    async def test_a_blob_reads_back_byte_for_byte(self, store: BlobStore) -> None:
        data = bytes(range(256)) * 1000 + b"\x00"
        ref = await store.put(WS, data, 1.0)
        assert await store.get(WS, ref, 2.0) == data

    async def test_size_tells_whether_get_would_find_the_blob(self, store: BlobStore) -> None:
        ref = await store.put(WS, b"x" * 3000, 10.0)
        assert await store.size(WS, ref, 11.0) == 3000
        assert await store.size(OTHER_WS, ref, 11.0) is None
        assert await store.size(WS, "b_unknown", 11.0) is None
        assert await store.size(WS, ref, 10.0 + RETENTION) is None  # expired, not yet swept
        empty = await store.put(WS, b"", 10.0)
        assert await store.size(WS, empty, 11.0) == 0

    async def test_an_empty_blob_is_a_blob(self, store: BlobStore) -> None:
        ref = await store.put(WS, b"", 1.0)
        assert await store.get(WS, ref, 2.0) == b""

    async def test_every_put_gets_its_own_reference(self, store: BlobStore) -> None:
        refs = await asyncio.gather(*(store.put(WS, str(i).encode(), 1.0) for i in range(20)))
        assert len(set(refs)) == 20
        for i, ref in enumerate(refs):
            assert await store.get(WS, ref, 2.0) == str(i).encode()

    async def test_a_reference_finds_nothing_in_another_workspace(self, store: BlobStore) -> None:
        ref = await store.put(WS, b"tenant a's pdf", 1.0)
        assert await store.get(OTHER_WS, ref, 2.0) is None
        assert await store.get(WS, "b_unknown", 2.0) is None

    async def test_a_blob_expires_after_the_retention_even_before_the_sweep(
        self, store: BlobStore
    ) -> None:
        ref = await store.put(WS, b"data", 10.0)
        assert await store.get(WS, ref, 10.0 + RETENTION - 0.5) == b"data"
        assert await store.get(WS, ref, 10.0 + RETENTION) is None

    async def test_the_sweep_deletes_expired_blobs_only(self, store: BlobStore) -> None:
        old = [await store.put(WS, b"old", 0.0) for _ in range(3)]
        young = await store.put(WS, b"young", 100.0)
        assert await store.sweep(RETENTION, limit=1) == 1
        assert await store.sweep(RETENTION) == 2
        assert await store.sweep(RETENTION) == 0
        assert await store.get(WS, young, RETENTION) == b"young"
        assert [await store.get(WS, ref, 0.0) for ref in old] == [None, None, None]
        with pytest.raises(ValueError, match="limit"):
            await store.sweep(RETENTION, limit=-1)

    async def test_references_come_from_the_injected_minter(self, new_store: NewStore) -> None:
        refs = iter(["b_1", "b_2"])
        store = new_store(retention=RETENTION, new_ref=lambda: next(refs))
        assert [await store.put(WS, b"a", 1.0), await store.put(WS, b"b", 1.0)] == ["b_1", "b_2"]
        assert await store.get(WS, "b_2", 2.0) == b"b"

    def test_a_retention_that_is_not_positive_is_refused(self, new_store: NewStore) -> None:
        with pytest.raises(ValueError, match="retention"):
            new_store(retention=float("inf"))
