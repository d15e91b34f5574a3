"""`QueueStore.has_claimable`, written once and run against every backend: whether a claim would
find a row, which the idle workers' long poll (`GET /v1/queue/pending`) asks on every poll.

It must agree with the claim on what is claimable (pending and available, or in progress under a
lapsed lease, in the worker's classes and workspaces) and claim nothing itself. A backend's test
class subclasses `ClaimableContract` next to `QueueContract` (same `store` fixture).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from cv_server.queue import QueueStore
from tests.contract.queue_contract import BACKOFF, LEASE, OTHER_WS, STAGE, WS, request


class ClaimableContract:
    @pytest.fixture
    async def store(self) -> AsyncIterator[QueueStore]:
        raise NotImplementedError("a backend's test class provides the store")
        yield  # noqa: PT022 - an async generator, like the overrides

    async def test_an_empty_queue_has_nothing_claimable(self, store: QueueStore) -> None:
        assert not await store.has_claimable(STAGE, 1.0)
        assert not await store.has_claimable([STAGE, "other"], None, workspace_ids=[WS])

    async def test_pending_work_is_claimable_for_its_class_only(self, store: QueueStore) -> None:
        await store.enqueue(request(), 10.0)
        assert await store.has_claimable(STAGE, 10.0)
        assert await store.has_claimable(["other", STAGE], 10.0)
        assert not await store.has_claimable("other", 10.0)
        assert not await store.has_claimable([], 10.0)
        # Asking claims nothing: the row is still pending, never dequeued.
        (row,) = await store.list()
        assert (row.status, row.dequeue_count) == ("pending", 0)
        assert await store.claim(STAGE, "w", LEASE, 10.0) is not None
        assert not await store.has_claimable(STAGE, 10.0)

    async def test_claimable_work_is_scoped_to_the_workspaces_asked(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request(ws=WS), 1.0)
        assert await store.has_claimable(STAGE, 1.0, workspace_ids=[WS])
        assert await store.has_claimable(STAGE, 1.0, workspace_ids=[OTHER_WS, WS])
        assert not await store.has_claimable(STAGE, 1.0, workspace_ids=[OTHER_WS])
        assert not await store.has_claimable(STAGE, 1.0, workspace_ids=[])
        # A lapsed lease too: another tenant's dead worker is not this worker's work.
        await store.claim(STAGE, "w", LEASE, 1.0)
        lapsed = 1.0 + LEASE + 1
        assert await store.has_claimable(STAGE, lapsed, workspace_ids=[WS])
        assert not await store.has_claimable(STAGE, lapsed, workspace_ids=[OTHER_WS])

    async def test_work_backing_off_is_claimable_only_once_available(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request(), 1.0)
        held = await store.claim(STAGE, "w", LEASE, 1.0)
        assert held is not None
        await store.fail(held.request_id, held.claim_token or "", None, BACKOFF, 2.0)
        assert not await store.has_claimable(STAGE, 2.0)
        assert not await store.has_claimable(STAGE, 2.0 + BACKOFF - 0.5)
        assert await store.has_claimable(STAGE, 2.0 + BACKOFF)
        assert await store.claim(STAGE, "w", LEASE, 2.0 + BACKOFF) is not None

    async def test_a_lapsed_lease_is_claimable_and_a_live_one_is_not(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request(), 1.0)
        held = await store.claim(STAGE, "w", LEASE, 1.0)
        assert held is not None
        assert not await store.has_claimable(STAGE, 1.0 + LEASE - 1)
        assert await store.has_claimable(STAGE, 1.0 + LEASE + 1)
        again = await store.claim(STAGE, "w2", LEASE, 1.0 + LEASE + 1)
        assert again is not None
        assert again.request_id == held.request_id

    async def test_a_lapsed_lease_out_of_dequeues_is_claimable_until_a_claim_parks_it(
        self, store: QueueStore
    ) -> None:
        """Claimable as the claim defines it: the claim that finds it parks it as poison (and
        announces it), after which nothing is left to claim."""
        await store.enqueue(request(max_dequeues=1), 1.0)
        assert await store.claim(STAGE, "w", LEASE, 1.0) is not None
        later = 1.0 + LEASE + 1
        assert await store.has_claimable(STAGE, later)
        assert await store.claim(STAGE, "w2", LEASE, later) is None
        assert [row.status for row in await store.list()] == ["poison"]
        assert not await store.has_claimable(STAGE, later)

    async def test_finished_and_cancelled_work_is_not_claimable(self, store: QueueStore) -> None:
        await store.enqueue(request("done"), 1.0)
        held = await store.claim(STAGE, "w", LEASE, 1.0)
        assert held is not None
        await store.complete(held.request_id, held.claim_token or "", {"ok": True}, 2.0)
        cancelled, _ = await store.enqueue(request("cancelled"), 3.0)
        await store.cancel(cancelled.request_id, 3.0)
        assert not await store.has_claimable(STAGE, 1e9)

    async def test_given_no_time_it_is_judged_on_the_store_clock(self, store: QueueStore) -> None:
        await store.enqueue(request("now"), None)
        assert await store.has_claimable(STAGE, None)
        # A request available an hour from the store's clock is not claimable now.
        future = await store.clock() + 3600
        await store.enqueue(request("later", worker_class="later"), future)
        assert not await store.has_claimable("later", None)
