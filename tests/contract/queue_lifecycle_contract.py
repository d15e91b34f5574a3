"""The queue rows' lifecycle contract (docs/queue.md, "How long a finished request is kept"):
`purge_finished` and `discard_poison`, written once and run against every backend.

A backend's test class subclasses `QueueLifecycleContract` beside `QueueContract` and adds one
fixture to those: `blob_store`, a `BlobStore` on the same database as `store`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from cv_server.queue import (
    BlobStore,
    NotDiscardable,
    ProcessRequest,
    Purged,
    QueueStore,
    RequestNotFound,
)
from tests.contract.queue_contract import BACKOFF, LEASE, STAGE, WS, request


class QueueLifecycleContract:
    """Finished rows are deleted on purpose only: by the purge after their retention (done,
    cancelled), or by an operator's discard (poison)."""

    @pytest.fixture
    async def blob_store(self) -> AsyncIterator[BlobStore]:
        raise NotImplementedError("a backend's test class provides the blob store")
        yield  # noqa: PT022 - an async generator, like the overrides

    async def _done(
        self, store: QueueStore, job: str, at: float, blob: BlobStore | None = None
    ) -> tuple[ProcessRequest, str | None]:
        await store.enqueue(request(job), at)
        held = await store.claim(STAGE, "w", LEASE, at)
        assert held is not None
        assert held.job_id == job
        ref = None if blob is None else await blob.put(WS, b"big result", at)
        await store.complete(held.request_id, held.claim_token or "", None, at, blob_ref=ref)
        return held, ref

    async def _poison(self, store: QueueStore, job: str, at: float) -> ProcessRequest:
        await store.enqueue(request(job, max_dequeues=1), at)
        held = await store.claim(STAGE, "w", LEASE, at)
        assert held is not None
        assert held.job_id == job
        row = await store.fail(held.request_id, held.claim_token or "", {"e": 1}, BACKOFF, at)
        assert row.status == "poison"
        return row

    async def test_purge_deletes_done_and_cancelled_rows_finished_by_then_oldest_first(
        self, store: QueueStore, blob_store: BlobStore
    ) -> None:
        done_old, ref_old = await self._done(store, "done-old", 10.0, blob_store)
        done_new, ref_new = await self._done(store, "done-new", 30.0, blob_store)
        cancelled, _ = await store.enqueue(request("cancelled"), 20.0)
        await store.cancel(cancelled.request_id, 20.0)
        poison = await self._poison(store, "poison", 5.0)
        pending, _ = await store.enqueue(request("pending"), 1.0)
        kept = await blob_store.put(WS, b"another's", 1.0)

        assert await store.purge_finished(25.0, limit=1) == Purged(requests=1, blobs=1)
        assert await store.get(WS, done_old.request_id) is None  # the oldest went first
        assert ref_old is not None
        assert await blob_store.get(WS, ref_old, 11.0) is None
        assert await store.purge_finished(25.0, limit=10) == Purged(requests=1, blobs=0)
        assert await store.get(WS, cancelled.request_id) is None
        assert await store.purge_finished(25.0, limit=10) == Purged(requests=0, blobs=0)
        # Finished later, live, or poison: kept, as are blobs no purged row names.
        for row in (done_new, poison, pending):
            assert await store.get(WS, row.request_id) is not None
        assert ref_new is not None
        assert await blob_store.get(WS, ref_new, 31.0) == b"big result"
        assert await blob_store.get(WS, kept, 2.0) == b"another's"
        assert await store.purge_finished(30.0, limit=10) == Purged(requests=1, blobs=1)
        assert {r.status for r in await store.list()} == {"poison", "pending"}

    async def test_a_deterministic_re_enqueue_after_the_purge_makes_a_new_row(
        self, store: QueueStore
    ) -> None:
        done, _ = await self._done(store, "job", 10.0)
        again, coalesced = await store.enqueue(request("job"), 20.0)
        assert (again.status, coalesced) == ("done", True)  # within retention: answered
        await store.purge_finished(15.0, limit=10)
        fresh, coalesced = await store.enqueue(request("job"), 30.0)
        assert (fresh.request_id, fresh.status, coalesced) == (done.request_id, "pending", False)
        held = await store.claim(STAGE, "w", LEASE, 30.0)
        assert held is not None
        assert held.request_id == done.request_id

    async def test_concurrent_purges_delete_each_row_once(
        self, store: QueueStore, peer_store: QueueStore
    ) -> None:
        for i in range(25):
            await self._done(store, f"job-{i}", float(i))
        results = await asyncio.gather(
            *(s.purge_finished(100.0, limit=4) for s in (store, peer_store) * 4)
        )
        rest = 0
        while (more := await store.purge_finished(100.0, limit=4)).requests:
            rest += more.requests
        assert sum(p.requests for p in results) + rest == 25
        assert await store.list() == []

    async def test_enqueues_racing_purges_of_their_row_always_answer(
        self, store: QueueStore, peer_store: QueueStore
    ) -> None:
        """An enqueue whose id conflicts with a row being purged either coalesces into it or
        makes a new row: never an error (PostgreSQL reads the row after the conflict)."""
        for round_ in range(15):
            at = float(round_ * 10)
            await self._done(store, "job", at)
            purged, (row, coalesced) = await asyncio.gather(
                peer_store.purge_finished(at, limit=10), store.enqueue(request("job"), at + 1)
            )
            assert purged.requests == 1
            # Before the purge: answered by the done row; after it: a new row.
            assert (row.status, coalesced) in {("done", True), ("pending", False)}
            after = await store.get(WS, row.request_id)
            assert (after and after.status) == (None if coalesced else "pending")

    async def test_a_purge_limit_below_one_is_refused(self, store: QueueStore) -> None:
        with pytest.raises(ValueError, match="limit"):
            await store.purge_finished(1.0, limit=0)

    async def test_discard_deletes_a_poison_row(self, store: QueueStore) -> None:
        poison = await self._poison(store, "job", 1.0)
        discarded = await store.discard_poison(poison.request_id)
        assert discarded == poison  # the row as it was
        assert await store.get(WS, poison.request_id) is None
        with pytest.raises(RequestNotFound):
            await store.discard_poison(poison.request_id)
        fresh, coalesced = await store.enqueue(request("job"), 2.0)  # a new row
        assert (fresh.status, fresh.dequeue_count, coalesced) == ("pending", 0, False)

    async def test_only_a_poison_row_may_be_discarded(self, store: QueueStore) -> None:
        done, _ = await self._done(store, "done", 1.0)
        pending, _ = await store.enqueue(request("pending"), 1.0)
        for row in (done, pending):
            with pytest.raises(NotDiscardable):
                await store.discard_poison(row.request_id)
            assert await store.get(WS, row.request_id) is not None
        with pytest.raises(RequestNotFound):
            await store.discard_poison("d_missing")
