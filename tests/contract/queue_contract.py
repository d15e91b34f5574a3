"""The work-queue contract (docs/queue.md), written once and run against every backend.

A backend's test class subclasses `QueueContract` and overrides three fixtures: `store`, a
`peer_store` on the same database reached through another connection (a second server process
or instance), and an `idempotency_store` on the same database as `store`.
Time is passed explicitly, so leases and backoffs are tested without waiting on any clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cv_server.config import ServerConfig
from cv_server.queue import (
    Completion,
    Enqueued,
    IdempotencyKeyLost,
    IdempotencyStore,
    InvalidTransition,
    KeyCompletion,
    LeaseLost,
    NewRequest,
    NotCancellable,
    Owned,
    ProcessRequest,
    QueueStore,
    RequestCancelled,
    RequestEvent,
    RequestIdConflict,
    RequestNotFound,
    StoredAnswer,
    StoredResponse,
    deterministic_request_id,
    random_request_id,
)

CONFIG = ServerConfig()
LEASE = CONFIG.lease_seconds
BACKOFF = CONFIG.failure_backoff_seconds
WS = "ws-1"
OTHER_WS = "ws-2"
STAGE = "evaluate"
BACKLOG = 60
CLAIMERS = 120


def request(
    job_id: str = "job-1",
    *,
    ws: str = WS,
    stage: str = STAGE,
    branch_path: str | None = "main",
    input: Any = None,
    worker_class: str | None = None,
    max_dequeues: int = CONFIG.max_dequeues,
    deterministic: bool = True,
) -> NewRequest:
    request_id = (
        deterministic_request_id(ws, job_id, branch_path, stage)
        if deterministic
        else random_request_id(secrets.token_hex(20))
    )
    return NewRequest(
        workspace_id=ws,
        stage=stage,
        request_id=request_id,
        input={"job": job_id} if input is None else input,
        job_id=job_id,
        branch_path=branch_path,
        worker_class=worker_class,
        max_dequeues=max_dequeues,
    )


class QueueContract:
    """Every `QueueStore` keeps these rules."""

    @pytest.fixture
    async def store(self) -> AsyncIterator[QueueStore]:
        raise NotImplementedError("a backend's test class provides the store")
        yield  # noqa: PT022 - an async generator, like the overrides

    @pytest.fixture
    async def peer_store(self, store: QueueStore) -> AsyncIterator[QueueStore]:
        raise NotImplementedError("a backend's test class provides a second instance")
        yield  # noqa: PT022 - an async generator, like the overrides

    @pytest.fixture
    async def idempotency_store(self, store: QueueStore) -> AsyncIterator[IdempotencyStore]:
        raise NotImplementedError("a backend's test class provides the idempotency store")
        yield  # noqa: PT022 - an async generator, like the overrides

    async def claimed(
        self, store: QueueStore, now: float, worker_class: str = STAGE, worker: str = "w1"
    ) -> ProcessRequest:
        row = await store.claim(worker_class, worker, LEASE, now)
        assert row is not None, "expected a claimable request"
        assert row.claim_token is not None
        return row

    # -- enqueue and coalescing -------------------------------------------------------------------

    async def test_an_enqueued_request_is_pending_and_claimable_at_once(
        self, store: QueueStore
    ) -> None:
        row, coalesced = await store.enqueue(request(input={"x": [1, "é"]}), 10.0)
        assert not coalesced
        assert row.status == "pending"
        assert (row.run, row.dequeue_count, row.available_at, row.created_at) == (1, 0, 10.0, 10.0)
        assert row.worker_class == STAGE
        assert await store.get(WS, row.request_id) == row
        claimed = await self.claimed(store, 10.0)
        assert claimed.request_id == row.request_id
        assert claimed.input == {"x": [1, "é"]}

    async def test_an_identical_live_request_coalesces_into_the_same_row(
        self, store: QueueStore
    ) -> None:
        first, _ = await store.enqueue(request(input={"v": 1}), 1.0)
        pending_again, coalesced = await store.enqueue(request(input={"v": 2}), 2.0)
        assert coalesced
        assert pending_again == first
        await self.claimed(store, 3.0)
        in_progress, coalesced = await store.enqueue(request(), 4.0, rerun=True)
        assert coalesced
        assert in_progress.status == "in_progress"
        assert len(await store.list(workspace_id=WS)) == 1

    async def test_a_request_keeps_the_grant_it_was_enqueued_under(self, store: QueueStore) -> None:
        """The enqueuer's grant (docs/queue.md) is stored with the row, read back by `get`,
        `claim` and `list`, and a row enqueued without one (the full grant) has None."""
        grant = {"scopes": ["enqueue"], "sub_docs": ["notes*", "x.y"]}
        limited = dataclasses.replace(
            request("J1", input={"v": 1}),
            request_id=deterministic_request_id(WS, "J1", "main", STAGE, "k1"),
            enqueue_grant=grant,
        )
        row, _ = await store.enqueue(limited, 1.0)
        full, _ = await store.enqueue(request("J2"), 1.0)
        assert row.enqueue_grant == grant
        assert full.enqueue_grant is None
        assert (await store.get(WS, row.request_id)) == row
        claimed = await self.claimed(store, 2.0)
        assert claimed.request_id == row.request_id
        assert claimed.enqueue_grant == grant
        listed = {r.request_id: r.enqueue_grant for r in await store.list(workspace_id=WS)}
        assert listed == {row.request_id: grant, full.request_id: None}

    async def test_many_concurrent_identical_enqueues_make_one_row(
        self, store: QueueStore, peer_store: QueueStore
    ) -> None:
        answers = await asyncio.gather(
            *((store if i % 2 else peer_store).enqueue(request(), 1.0) for i in range(40))
        )
        assert sum(1 for a in answers if not a.coalesced) == 1
        assert {a.row.request_id for a in answers} == {answers[0].row.request_id}
        assert len(await store.list()) == 1

    async def test_a_finished_deterministic_request_answers_a_plain_re_enqueue(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request(), 1.0)
        held = await self.claimed(store, 2.0)
        done = await store.complete(held.request_id, held.claim_token or "", {"score": 7}, 3.0)
        again, coalesced = await store.enqueue(request(input={"other": True}), 4.0)
        assert coalesced
        assert again == done
        assert await store.claim(STAGE, "w2", LEASE, 5.0) is None

    async def test_rerun_reopens_a_finished_request_as_its_next_run(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request(), 1.0)
        held = await self.claimed(store, 2.0)
        await store.complete(held.request_id, held.claim_token or "", {"score": 7}, 3.0)
        reopened, coalesced = await store.enqueue(request(input={"v": 2}), 4.0, rerun=True)
        assert not coalesced
        assert reopened.request_id == held.request_id
        assert (reopened.status, reopened.run, reopened.dequeue_count) == ("pending", 2, 0)
        assert (reopened.result, reopened.input, reopened.created_at) == (None, {"v": 2}, 4.0)
        second = await self.claimed(store, 5.0)
        assert (second.run, second.input) == (2, {"v": 2})
        with pytest.raises(LeaseLost):  # the first run's token is dead for good
            await store.complete(held.request_id, held.claim_token or "", {"late": 1}, 6.0)

    async def test_a_poison_request_is_not_reopened_by_a_plain_enqueue(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request(max_dequeues=1), 1.0)
        held = await self.claimed(store, 2.0)
        parked = await store.fail(held.request_id, held.claim_token or "", {"code": "x"}, 0, 3.0)
        assert parked.status == "poison"
        again, coalesced = await store.enqueue(request(max_dequeues=1), 4.0)
        assert coalesced
        assert again.status == "poison"
        assert await store.claim(STAGE, "w", LEASE, 5.0) is None

    async def test_a_request_id_of_another_workspace_is_refused(self, store: QueueStore) -> None:
        mine = request()
        await store.enqueue(mine, 1.0)
        theirs = dataclasses.replace(request(ws=OTHER_WS), request_id=mine.request_id)
        with pytest.raises(RequestIdConflict):
            await store.enqueue(theirs, 2.0)

    async def test_get_is_scoped_to_the_workspace(self, store: QueueStore) -> None:
        row, _ = await store.enqueue(request(), 1.0)
        assert await store.get(WS, row.request_id) is not None
        assert await store.get(OTHER_WS, row.request_id) is None
        assert await store.get(WS, "d_unknown") is None

    async def test_get_many_returns_the_known_rows(self, store: QueueStore) -> None:
        a, _ = await store.enqueue(request("a"), 1.0)
        b, _ = await store.enqueue(request("b", ws=OTHER_WS), 1.0)
        found = await store.get_many([a.request_id, b.request_id, "d_missing", a.request_id])
        assert sorted(found, key=lambda r: r.job_id or "") == [a, b]
        assert await store.get_many([]) == []

    # -- claim ------------------------------------------------------------------------------------

    async def test_concurrent_claimers_never_get_the_same_row(
        self, store: QueueStore, peer_store: QueueStore
    ) -> None:
        for i in range(BACKLOG):
            await store.enqueue(request(f"job-{i}"), float(i))
        claims = await asyncio.gather(
            *(
                (store if i % 2 else peer_store).claim(STAGE, f"w{i}", LEASE, 1000.0)
                for i in range(CLAIMERS)
            )
        )
        won = [row for row in claims if row is not None]
        assert len(won) == BACKLOG
        assert len({row.request_id for row in won}) == BACKLOG
        assert len({row.claim_token for row in won}) == BACKLOG
        assert all(row.dequeue_count == 1 for row in won)
        assert await store.claim(STAGE, "late", LEASE, 1000.0) is None

    async def test_claim_hands_out_the_oldest_request_first(self, store: QueueStore) -> None:
        for i in (3, 1, 2):
            await store.enqueue(request(f"job-{i}"), float(i))
        order = [(await self.claimed(store, 10.0)).job_id for _ in range(3)]
        assert order == ["job-1", "job-2", "job-3"]

    async def test_requests_enqueued_at_the_same_instant_are_claimed_in_enqueue_order(
        self, store: QueueStore
    ) -> None:
        for i in range(5):
            await store.enqueue(request(f"job-{i}"), 1.0)
        order = [(await self.claimed(store, 2.0)).job_id for _ in range(5)]
        assert order == [f"job-{i}" for i in range(5)]

    async def test_claim_sets_a_fresh_token_and_lease(self, store: QueueStore) -> None:
        await store.enqueue(request(), 1.0)
        row = await store.claim(STAGE, "worker-7", LEASE, 5.0)
        assert row is not None
        assert row.status == "in_progress"
        assert (row.claimed_by, row.claimed_at, row.lease_expires_at) == (
            "worker-7",
            5.0,
            5 + LEASE,
        )
        assert row.dequeue_count == 1
        assert await store.get(WS, row.request_id) == row

    async def test_claim_only_takes_the_asked_worker_classes(self, store: QueueStore) -> None:
        await store.enqueue(request("a", worker_class="gpu"), 1.0)
        await store.enqueue(request("b", stage="tailor"), 2.0)
        await store.enqueue(request("c"), 3.0)
        assert await store.claim("other", "w", LEASE, 10.0) is None
        gpu = await self.claimed(store, 10.0, worker_class="gpu")
        assert gpu.job_id == "a"
        both = [await store.claim([STAGE, "tailor"], "w", LEASE, 10.0) for _ in range(3)]
        assert [r.job_id if r else None for r in both] == ["b", "c", None]

    async def test_claim_is_restricted_to_the_allowed_workspaces(self, store: QueueStore) -> None:
        await store.enqueue(request("a", ws=OTHER_WS), 1.0)
        await store.enqueue(request("b"), 2.0)
        assert await store.claim(STAGE, "w", LEASE, 5.0, workspace_ids=[]) is None
        mine = await store.claim(STAGE, "w", LEASE, 5.0, workspace_ids=[WS])
        assert mine is not None
        assert mine.job_id == "b"
        assert await store.claim(STAGE, "w", LEASE, 5.0, workspace_ids=[WS, "ws-9"]) is None
        theirs = await store.claim(STAGE, "w", LEASE, 5.0, workspace_ids=[OTHER_WS])
        assert theirs is not None
        assert theirs.job_id == "a"

    async def test_a_held_lease_is_not_claimable_until_it_lapses(self, store: QueueStore) -> None:
        await store.enqueue(request(), 0.0)
        held = await self.claimed(store, 0.0)
        assert await store.claim(STAGE, "w2", LEASE, LEASE) is None  # lapses strictly after
        again = await store.claim(STAGE, "w2", LEASE, LEASE + 0.5)
        assert again is not None
        assert again.request_id == held.request_id
        assert again.claim_token != held.claim_token
        assert again.dequeue_count == 2

    async def test_a_lapsed_lease_that_became_claimable_first_is_claimed_first(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request("dead"), 0.0)
        await self.claimed(store, 0.0)
        await store.enqueue(request("fresh"), LEASE + 5)
        row = await self.claimed(store, LEASE + 10)
        assert row.job_id == "dead"

    async def test_the_old_holder_of_a_reclaimed_request_can_write_nothing(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request(), 0.0)
        old = await self.claimed(store, 0.0)
        new = await self.claimed(store, LEASE + 1, worker="w2")
        before = await store.get(WS, new.request_id)
        old_token = old.claim_token or ""
        with pytest.raises(LeaseLost):
            await store.heartbeat(old.request_id, old_token, LEASE, LEASE + 2)
        with pytest.raises(LeaseLost):
            await store.complete(old.request_id, old_token, {"stale": True}, LEASE + 2)
        with pytest.raises(LeaseLost):
            await store.fail(old.request_id, old_token, {"code": "boom"}, BACKOFF, LEASE + 2)
        assert await store.get(WS, new.request_id) == before
        done = await store.complete(new.request_id, new.claim_token or "", {"ok": 1}, LEASE + 3)
        assert done.result == {"ok": 1}

    async def test_a_lapsed_lease_nobody_reclaimed_still_lets_its_holder_finish(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request(), 0.0)
        held = await self.claimed(store, 0.0)
        done = await store.complete(held.request_id, held.claim_token or "", 1, LEASE * 2)
        assert done.status == "done"

    async def test_heartbeat_extends_the_lease(self, store: QueueStore) -> None:
        await store.enqueue(request(), 0.0)
        held = await self.claimed(store, 0.0)
        beat = await store.heartbeat(held.request_id, held.claim_token or "", LEASE, 60.0)
        assert beat.lease_expires_at == 60.0 + LEASE
        assert await store.claim(STAGE, "w2", LEASE, LEASE + 1) is None
        assert await store.claim(STAGE, "w2", LEASE, 60.0 + LEASE + 1) is not None

    async def test_a_wrong_token_is_refused_and_an_unknown_id_is_not_found(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request(), 0.0)
        held = await self.claimed(store, 0.0)
        with pytest.raises(LeaseLost):
            await store.heartbeat(held.request_id, "not-the-token", LEASE, 1.0)
        with pytest.raises(RequestNotFound):
            await store.heartbeat("d_missing", "t", LEASE, 1.0)
        with pytest.raises(RequestNotFound):
            await store.complete("d_missing", "t", None, 1.0)
        with pytest.raises(RequestNotFound):
            await store.fail("d_missing", "t", None, BACKOFF, 1.0)
        with pytest.raises(RequestNotFound):
            await store.replay_poison("d_missing", 1.0)

    async def test_a_negative_lease_or_backoff_is_refused(self, store: QueueStore) -> None:
        await store.enqueue(request(), 0.0)
        with pytest.raises(ValueError, match="lease"):
            await store.claim(STAGE, "w", -1.0, 1.0)
        held = await self.claimed(store, 1.0)
        with pytest.raises(ValueError, match="backoff"):
            await store.fail(held.request_id, held.claim_token or "", None, float("nan"), 2.0)

    # -- batches ----------------------------------------------------------------------------------

    async def test_claim_many_takes_the_oldest_requests_each_under_its_own_token(
        self, store: QueueStore
    ) -> None:
        for i in (4, 1, 3, 2, 0):
            await store.enqueue(request(f"job-{i}", stage="tailor" if i % 2 else STAGE), float(i))
        batch = await store.claim_many([STAGE, "tailor"], "w", LEASE, 10.0, limit=3)
        assert [r.job_id for r in batch] == ["job-0", "job-1", "job-2"]
        assert len({r.claim_token for r in batch}) == 3
        assert all(r.status == "in_progress" and r.dequeue_count == 1 for r in batch)
        rest = await store.claim_many([STAGE, "tailor"], "w", LEASE, 10.0, limit=10)
        assert [r.job_id for r in rest] == ["job-3", "job-4"]
        assert await store.claim_many(STAGE, "w", LEASE, 10.0, limit=10) == []
        with pytest.raises(ValueError, match="limit"):
            await store.claim_many(STAGE, "w", LEASE, 10.0, limit=0)

    async def test_concurrent_batch_claimers_never_get_the_same_row(
        self, store: QueueStore, peer_store: QueueStore
    ) -> None:
        for i in range(BACKLOG):
            await store.enqueue(request(f"job-{i}"), float(i))
        batches = await asyncio.gather(
            *(
                (store if i % 2 else peer_store).claim_many(STAGE, f"w{i}", LEASE, 1000.0, limit=7)
                for i in range(CLAIMERS // 4)
            )
        )
        won = [row.request_id for batch in batches for row in batch]
        assert len(won) == BACKLOG
        assert len(set(won)) == BACKLOG

    async def test_claim_many_parks_exhausted_lapsed_rows_and_still_fills_the_batch(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request("doomed", max_dequeues=1), 0.0)
        await self.claimed(store, 0.0)
        for i in range(3):
            await store.enqueue(request(f"job-{i}"), 1.0 + i)
        batch = await store.claim_many(STAGE, "w", LEASE, 2 * LEASE, limit=3)
        assert [r.job_id for r in batch] == ["job-0", "job-1", "job-2"]
        doomed = await store.get(WS, request("doomed").request_id)
        assert doomed is not None
        assert doomed.status == "poison"

    async def test_complete_many_answers_each_completion_on_its_own(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request("a"), 0.0)
        await store.enqueue(request("b"), 1.0)
        a, b = await store.claim_many(STAGE, "w", LEASE, 2.0, limit=2)
        b_before = await store.get(WS, b.request_id)
        outcomes = await store.complete_many(
            [
                Completion(a.request_id, a.claim_token or "", {"v": "a"}, cache="hit"),
                Completion(b.request_id, "stale-token", {"v": "b"}),
                Completion("d_missing", "t", None),
            ],
            3.0,
        )
        done, refused, missing = outcomes
        assert isinstance(done, ProcessRequest)
        assert (done.status, done.result, done.cache) == ("done", {"v": "a"}, "hit")
        assert isinstance(refused, LeaseLost)
        assert isinstance(missing, RequestNotFound)
        assert await store.get(WS, b.request_id) == b_before
        assert await store.complete_many([], 4.0) == []

    # -- finishing --------------------------------------------------------------------------------

    async def test_complete_stores_the_result_and_its_details(self, store: QueueStore) -> None:
        await store.enqueue(request(), 1.0)
        held = await self.claimed(store, 2.0)
        done = await store.complete(
            held.request_id,
            held.claim_token or "",
            {"rows": [1, 2]},
            3.0,
            blob_ref="b_abc",
            cache="miss",
            telemetry={"wall": 0.5, "queue_wait": 1.0},
        )
        assert (done.status, done.result, done.error, done.finished_at) == (
            "done",
            {"rows": [1, 2]},
            None,
            3.0,
        )
        assert (done.blob_ref, done.cache, done.telemetry) == (
            "b_abc",
            "miss",
            {"wall": 0.5, "queue_wait": 1.0},
        )
        assert await store.get(WS, held.request_id) == done
        assert await store.claim(STAGE, "w", LEASE, 10_000.0) is None

    async def test_a_retried_complete_by_the_holder_returns_the_finished_row(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request(), 1.0)
        held = await self.claimed(store, 2.0)
        first = await store.complete(held.request_id, held.claim_token or "", {"v": 1}, 3.0)
        retry = await store.complete(held.request_id, held.claim_token or "", {"v": 2}, 4.0)
        assert retry == first
        with pytest.raises(LeaseLost):  # but nothing else works on a finished row
            await store.heartbeat(held.request_id, held.claim_token or "", LEASE, 5.0)

    async def test_an_expected_error_completes_with_its_payload_after_one_attempt(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request(), 1.0)
        held = await self.claimed(store, 2.0)
        payload = {"code": "not_found", "message": "job-1 is gone"}
        done = await store.complete(
            held.request_id, held.claim_token or "", None, 3.0, error=payload
        )
        assert (done.status, done.error, done.dequeue_count) == ("done", payload, 1)
        assert await store.claim(STAGE, "w", LEASE, 10_000.0) is None

    async def test_fail_backs_off_before_the_request_is_claimable_again(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request(), 0.0)
        held = await self.claimed(store, 10.0)
        error = {"code": "internal", "message": "provider timeout"}
        back = await store.fail(held.request_id, held.claim_token or "", error, BACKOFF, 11.0)
        assert (back.status, back.available_at, back.error) == ("pending", 11.0 + BACKOFF, error)
        assert await store.claim(STAGE, "w", LEASE, 11.0 + BACKOFF - 0.5) is None
        again = await store.claim(STAGE, "w", LEASE, 11.0 + BACKOFF)
        assert again is not None
        assert again.dequeue_count == 2
        with pytest.raises(LeaseLost):  # the old token's fail is no longer a retry
            await store.fail(held.request_id, held.claim_token or "", error, BACKOFF, 12.0)
        assert await store.get(WS, held.request_id) == again

    async def test_a_retried_fail_by_the_holder_returns_the_row_unchanged(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request(), 0.0)
        held = await self.claimed(store, 1.0)
        first = await store.fail(held.request_id, held.claim_token or "", {"n": 1}, BACKOFF, 2.0)
        retry = await store.fail(held.request_id, held.claim_token or "", {"n": 2}, BACKOFF, 3.0)
        assert retry == first

    async def test_a_request_that_keeps_failing_ends_in_poison(self, store: QueueStore) -> None:
        await store.enqueue(request(max_dequeues=3), 0.0)
        now = 1.0
        statuses = []
        for attempt in range(3):
            held = await self.claimed(store, now)
            assert held.dequeue_count == attempt + 1
            after = await store.fail(
                held.request_id, held.claim_token or "", {"n": attempt}, 0, now
            )
            statuses.append(after.status)
            now += 1
        assert statuses == ["pending", "pending", "poison"]
        parked = await store.get(WS, held.request_id)
        assert parked is not None
        assert (parked.error, parked.finished_at) == ({"n": 2}, now - 1)
        assert await store.claim(STAGE, "w", LEASE, now + 10_000) is None
        assert [r.request_id for r in await store.list(status="poison")] == [held.request_id]

    async def test_a_request_whose_workers_keep_dying_ends_in_poison(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request("doomed", max_dequeues=2), 0.0)
        await self.claimed(store, 0.0)
        await self.claimed(store, LEASE + 1)
        await store.enqueue(request("next"), 5.0)
        row = await self.claimed(store, 3 * LEASE)  # the doomed row lapsed after its last dequeue
        assert row.job_id == "next"
        doomed = await store.get(WS, request("doomed").request_id)
        assert doomed is not None
        assert (doomed.status, doomed.dequeue_count) == ("poison", 2)
        assert doomed.error is not None

    # -- operators --------------------------------------------------------------------------------

    async def test_replay_poison_puts_the_request_back_with_a_fresh_budget(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request(max_dequeues=1), 0.0)
        held = await self.claimed(store, 1.0)
        await store.fail(held.request_id, held.claim_token or "", {"code": "bug"}, BACKOFF, 2.0)
        replayed = await store.replay_poison(held.request_id, 100.0)
        assert (replayed.status, replayed.dequeue_count, replayed.available_at) == (
            "pending",
            0,
            100.0,
        )
        assert replayed.run == 1  # the same run resumes: its writes still dedupe
        again = await self.claimed(store, 100.0)
        assert again.request_id == held.request_id
        with pytest.raises(InvalidTransition):
            await store.replay_poison(held.request_id, 101.0)

    async def test_list_filters_by_status_and_workspace_oldest_first(
        self, store: QueueStore
    ) -> None:
        for i in range(4):
            await store.enqueue(request(f"job-{i}"), float(i))
        await store.enqueue(request("theirs", ws=OTHER_WS), 10.0)
        await self.claimed(store, 20.0)
        assert [r.job_id for r in await store.list(status="pending", workspace_id=WS)] == [
            "job-1",
            "job-2",
            "job-3",
        ]
        assert [r.job_id for r in await store.list(status="in_progress")] == ["job-0"]
        assert [r.job_id for r in await store.list(workspace_id=OTHER_WS)] == ["theirs"]
        assert [r.job_id for r in await store.list(limit=2)] == ["job-0", "job-1"]
        assert await store.list(status="done") == []

    # -- cancel -----------------------------------------------------------------------------------

    async def test_a_cancelled_pending_request_finishes_at_once_and_is_never_claimed(
        self, store: QueueStore
    ) -> None:
        heard: list[str] = []
        store.add_listener(lambda e: heard.append(e.status))
        row, _ = await store.enqueue(request(), 1.0)
        cancelled = await store.cancel(row.request_id, 2.0)
        assert (cancelled.status, cancelled.finished_at, cancelled.cancel_requested) == (
            "cancelled",
            2.0,
            False,
        )
        assert await store.get(WS, row.request_id) == cancelled
        assert await store.claim(STAGE, "w", LEASE, 10_000.0) is None
        assert heard == ["pending", "cancelled"]
        assert [r.request_id for r in await store.list(status="cancelled")] == [row.request_id]
        # Cancelling twice changes nothing; a plain re-enqueue answers the cancelled row and a
        # rerun re-opens it on purpose as its next run.
        assert await store.cancel(row.request_id, 3.0) == cancelled
        again, coalesced = await store.enqueue(request(), 4.0)
        assert coalesced
        assert again.status == "cancelled"
        rerun, coalesced = await store.enqueue(request(), 5.0, rerun=True)
        assert (rerun.status, rerun.run, rerun.cancel_requested, coalesced) == (
            "pending",
            2,
            False,
            False,
        )

    async def test_a_backed_off_pending_request_is_cancelled_at_once(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request(), 1.0)
        held = await self.claimed(store, 1.0)
        await store.fail(held.request_id, held.claim_token or "", {"code": "x"}, BACKOFF, 2.0)
        cancelled = await store.cancel(held.request_id, 3.0)  # still inside its backoff
        assert cancelled.status == "cancelled"
        # The last holder's retried fail is answered with the row, not refused.
        retried = await store.fail(held.request_id, held.claim_token or "", {"code": "x"}, 0, 4.0)
        assert retried == cancelled

    async def test_a_cancel_in_progress_is_heard_at_the_holders_next_heartbeat(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request(), 1.0)
        held = await self.claimed(store, 1.0)
        token = held.claim_token or ""
        asked = await store.cancel(held.request_id, 2.0)
        assert (asked.status, asked.cancel_requested) == ("in_progress", True)
        assert asked.lease_expires_at == held.lease_expires_at
        assert await store.cancel(held.request_id, 2.5) == asked  # asking twice: no change
        with pytest.raises(LeaseLost):  # fenced like every holder verb
            await store.heartbeat(held.request_id, "not-the-token", LEASE, 3.0)
        with pytest.raises(RequestCancelled):
            await store.heartbeat(held.request_id, token, LEASE, 3.0)
        unextended = await store.get(WS, held.request_id)
        assert unextended == asked  # the refused heartbeat extended nothing
        with pytest.raises(LeaseLost):
            await store.fail(held.request_id, "not-the-token", {"code": "x"}, BACKOFF, 4.0)
        stopped = await store.fail(held.request_id, token, {"code": "cancelled"}, BACKOFF, 4.0)
        assert (stopped.status, stopped.finished_at, stopped.error) == (
            "cancelled",
            4.0,
            {"code": "cancelled"},
        )
        assert await store.claim(STAGE, "w", LEASE, 10_000.0) is None

    async def test_a_holder_that_finished_before_hearing_of_the_cancel_completes(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request(), 1.0)
        held = await self.claimed(store, 1.0)
        await store.cancel(held.request_id, 2.0)
        done = await store.complete(held.request_id, held.claim_token or "", {"ok": 1}, 3.0)
        assert (done.status, done.result, done.cancel_requested) == ("done", {"ok": 1}, True)

    async def test_a_cancelled_request_whose_holder_died_is_parked_as_cancelled(
        self, store: QueueStore
    ) -> None:
        heard: list[str] = []
        await store.enqueue(request("dead"), 1.0)
        held = await self.claimed(store, 1.0)
        await store.cancel(held.request_id, 2.0)
        await store.enqueue(request("next"), 3.0)
        store.add_listener(lambda e: heard.append(e.status))
        lapsed = (held.lease_expires_at or 0.0) + 1
        claimed = await self.claimed(store, lapsed)
        assert claimed.job_id == "next"  # the cancelled one is never handed out again
        parked = await store.get(WS, held.request_id)
        assert parked is not None
        assert (parked.status, parked.finished_at, parked.dequeue_count) == (
            "cancelled",
            lapsed,
            1,
        )
        assert "cancelled" in heard
        # A cancel that finds the lease already lapsed cancels at once.
        await store.enqueue(request("late"), lapsed)
        late = await self.claimed(store, lapsed)
        now = (late.lease_expires_at or 0.0) + 1
        assert (await store.cancel(late.request_id, now)).status == "cancelled"

    async def test_done_and_poison_requests_are_not_cancellable(self, store: QueueStore) -> None:
        await store.enqueue(request("done"), 1.0)
        held = await self.claimed(store, 1.0)
        done = await store.complete(held.request_id, held.claim_token or "", None, 2.0)
        await store.enqueue(request("poison", max_dequeues=1), 3.0)
        doomed = await self.claimed(store, 3.0)
        poison = await store.fail(doomed.request_id, doomed.claim_token or "", None, 0, 4.0)
        assert poison.status == "poison"
        for row in (done, poison):
            with pytest.raises(NotCancellable):
                await store.cancel(row.request_id, 5.0)
            assert await store.get(WS, row.request_id) == row
        with pytest.raises(RequestNotFound):
            await store.cancel("d_missing", 5.0)

    # -- notifications ----------------------------------------------------------------------------

    async def test_listeners_hear_every_status_change_after_it_committed(
        self, store: QueueStore
    ) -> None:
        events: list[RequestEvent] = []
        seen: list[ProcessRequest | None] = []
        reads: list[asyncio.Task[ProcessRequest | None]] = []

        def listener(event: RequestEvent) -> None:
            events.append(event)
            reads.append(asyncio.ensure_future(store.get(event.workspace_id, event.request_id)))

        store.add_listener(listener)
        await store.enqueue(request(), 1.0)
        await store.enqueue(request(), 1.5)  # coalesced: no change, no event
        held = await self.claimed(store, 2.0)
        await store.heartbeat(held.request_id, held.claim_token or "", LEASE, 2.5)  # no change
        await store.complete(held.request_id, held.claim_token or "", {"ok": True}, 3.0)
        seen.extend(await asyncio.gather(*reads))
        assert [e.status for e in events] == ["pending", "in_progress", "done"]
        assert {(e.workspace_id, e.request_id, e.run) for e in events} == {(WS, held.request_id, 1)}
        assert seen[-1] is not None
        assert seen[-1].status == "done"

    async def test_a_cancelled_caller_does_not_silence_the_announcement(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request(), 1.0)
        held = await self.claimed(store, 2.0)
        finished = asyncio.Event()
        store.add_listener(lambda e: finished.set() if e.status == "done" else None)
        task = asyncio.ensure_future(
            store.complete(held.request_id, held.claim_token or "", {"v": 1}, 3.0)
        )
        await asyncio.sleep(0)  # let the verb start, then abandon it
        task.cancel()
        await asyncio.wait_for(finished.wait(), timeout=10)
        row = await store.get(WS, held.request_id)
        assert row is not None
        assert row.status == "done"

    async def test_a_failing_listener_neither_breaks_the_verb_nor_other_listeners(
        self, store: QueueStore
    ) -> None:
        heard: list[str] = []

        def broken(event: RequestEvent) -> None:
            raise RuntimeError("waiter bug")

        store.add_listener(broken)
        remove = store.add_listener(lambda e: heard.append(e.status))
        await store.enqueue(request("a"), 1.0)
        remove()
        await store.enqueue(request("b"), 2.0)
        assert heard == ["pending"]

    async def test_poison_is_announced_to_waiters(self, store: QueueStore) -> None:
        statuses: list[str] = []
        store.add_listener(lambda e: statuses.append(e.status))
        await store.enqueue(request(max_dequeues=1), 0.0)
        await self.claimed(store, 0.0)
        await store.enqueue(request("other"), 1.0)
        await store.claim(STAGE, "w", LEASE, LEASE * 2)
        assert statuses == ["pending", "in_progress", "pending", "poison", "in_progress"]

    # -- observers (this process's metrics and logs) ----------------------------------------------

    async def test_observers_hear_each_transition_of_this_process_with_its_verb(
        self, store: QueueStore, peer_store: QueueStore
    ) -> None:
        seen: list[tuple[str | None, str, bool]] = []
        rows: list[ProcessRequest | None] = []

        def observe(event: RequestEvent) -> None:
            seen.append((event.kind, event.status, event.lapsed))
            rows.append(event.row)

        store.add_observer(observe)
        peer_heard: list[str] = []
        peer_store.add_observer(lambda e: peer_heard.append(e.status))
        await store.enqueue(request(), 1.0)
        await store.enqueue(request(), 1.5)  # coalesced: nothing written, nothing observed
        held = await self.claimed(store, 2.0)
        await store.heartbeat(held.request_id, held.claim_token or "", LEASE, 2.5)
        # the lease lapses; a later claim (of another worker) finds it lapsed
        again = await self.claimed(store, 2.0 + LEASE * 2, worker="w2")
        await store.fail(again.request_id, again.claim_token or "", {"code": "x"}, BACKOFF, 300.0)
        third = await self.claimed(store, 300.0 + BACKOFF)
        await store.complete(third.request_id, third.claim_token or "", 1, 400.0)
        # one whose only dequeue lapses: parked as poison by a claim, then replayed
        await store.enqueue(request("p", max_dequeues=1), 500.0)
        await self.claimed(store, 500.0)
        assert await store.claim(STAGE, "w3", LEASE, 500.0 + LEASE * 2) is None
        poisoned = await store.get(WS, request("p").request_id)
        assert poisoned is not None
        await store.replay_poison(poisoned.request_id, 1000.0)
        assert seen == [
            ("enqueued", "pending", False),
            ("claimed", "in_progress", False),
            ("claimed", "in_progress", True),
            ("failed", "pending", False),
            ("claimed", "in_progress", False),
            ("done", "done", False),
            ("enqueued", "pending", False),
            ("claimed", "in_progress", False),
            ("poisoned", "poison", True),
            ("replayed", "pending", False),
        ]
        assert all(row is not None for row in rows)
        done = rows[5]
        assert done is not None
        assert (done.status, done.claimed_by, done.result) == ("done", "w1", 1)
        # Another instance's observers hear nothing of these (its own commits only), whatever
        # its listeners hear through the database's notifications.
        assert peer_heard == []

    async def test_status_counts_count_every_request_of_every_workspace(
        self, store: QueueStore
    ) -> None:
        assert await store.status_counts() == {}
        for i in range(3):
            await store.enqueue(request(f"j{i}"), 1.0)
        await store.enqueue(request("other", ws=OTHER_WS), 1.0)
        held = await self.claimed(store, 2.0)
        await store.complete(held.request_id, held.claim_token or "", None, 3.0)
        await self.claimed(store, 4.0)
        assert await store.status_counts() == {"pending": 2, "in_progress": 1, "done": 1}

    # -- the store's clock (now=None) -------------------------------------------------------------

    async def test_the_store_clock_is_shared_by_every_instance(
        self, store: QueueStore, peer_store: QueueStore
    ) -> None:
        first = await store.clock()
        second = await peer_store.clock()
        third = await store.clock()
        assert first <= second <= third

    async def test_verbs_given_no_time_take_it_from_the_store_clock(
        self, store: QueueStore
    ) -> None:
        # Readings of the store's clock before and after each verb bracket the time it wrote.
        before = await store.clock()
        new, _ = await store.enqueue(request(), None)
        after = await store.clock()
        assert before <= new.created_at == new.available_at <= after

        before = await store.clock()
        held = await store.claim(STAGE, "w1", LEASE, None)
        after = await store.clock()
        assert held is not None
        assert held.claim_token is not None
        assert held.claimed_at is not None
        assert before <= held.claimed_at <= after
        assert held.lease_expires_at == held.claimed_at + LEASE
        assert await store.claim(STAGE, "w2", LEASE, None) is None  # its lease is live

        before = await store.clock()
        beat = await store.heartbeat(held.request_id, held.claim_token, LEASE, None)
        after = await store.clock()
        assert beat.lease_expires_at is not None
        assert before + LEASE <= beat.lease_expires_at <= after + LEASE

        before = await store.clock()
        failed = await store.fail(held.request_id, held.claim_token, {"m": "x"}, BACKOFF, None)
        after = await store.clock()
        assert failed.status == "pending"
        assert before + BACKOFF <= failed.available_at <= after + BACKOFF
        assert await store.claim(STAGE, "w2", LEASE, None) is None  # backed off

    async def test_batch_and_operator_verbs_given_no_time_take_it_from_the_store_clock(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request("a"), None)
        await store.enqueue(request("b", max_dequeues=1), None)
        before = await store.clock()
        batch = await store.claim_many(STAGE, "w1", LEASE, None, limit=2)
        after = await store.clock()
        assert len(batch) == 2
        assert all(r.claimed_at is not None and before <= r.claimed_at <= after for r in batch)
        first, second = batch
        assert first.claim_token is not None
        assert second.claim_token is not None

        unknown = Completion("no-such-request", "token", None)
        assert isinstance(
            (await store.complete_many([unknown], None))[0], RequestNotFound
        )  # no row to read the time with: nothing needs it
        before = await store.clock()
        done, missing = await store.complete_many(
            [Completion(first.request_id, first.claim_token, {"ok": 1}), unknown], None
        )
        after = await store.clock()
        assert isinstance(done, ProcessRequest)
        assert isinstance(missing, RequestNotFound)
        assert done.finished_at is not None
        assert before <= done.finished_at <= after

        poison = await store.fail(second.request_id, second.claim_token, {"m": "x"}, BACKOFF, None)
        assert poison.status == "poison"
        before = await store.clock()
        replayed = await store.replay_poison(second.request_id, None)
        after = await store.clock()
        assert before <= replayed.available_at <= after

    async def test_a_rerun_given_no_time_reopens_at_the_store_clock(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request(), 1.0)
        held = await self.claimed(store, 1.0)
        assert held.claim_token is not None
        await store.complete(held.request_id, held.claim_token, {"ok": 1}, 2.0)
        before = await store.clock()
        rerun, coalesced = await store.enqueue(request(), None, rerun=True)
        after = await store.clock()
        assert not coalesced
        assert rerun.run == 2
        assert before <= rerun.created_at == rerun.available_at <= after
        answered, coalesced = await store.enqueue(request(), None)  # the live row, as it stands
        assert coalesced
        assert answered == rerun

    # -- idempotency keys committed with the enqueue ----------------------------------------------

    async def test_an_enqueue_completes_its_idempotency_key_in_the_same_transaction(
        self, store: QueueStore, idempotency_store: IdempotencyStore
    ) -> None:
        req = request(deterministic=False)
        assert isinstance(await idempotency_store.begin(WS, "key-1", "fp", 1.0), Owned)

        def respond(answer: Enqueued) -> StoredResponse:
            body = {"request_id": answer.row.request_id, "coalesced": answer.coalesced}
            return StoredResponse(202, body)

        completion = KeyCompletion[Enqueued](WS, "key-1", "fp", respond)
        row, _ = await store.enqueue(req, 1.0, idempotency=completion)
        replay = await idempotency_store.begin(WS, "key-1", "fp", 2.0)
        assert replay == StoredAnswer(202, {"request_id": row.request_id, "coalesced": False})

    async def test_an_enqueue_whose_idempotency_key_was_lost_is_rolled_back(
        self, store: QueueStore, idempotency_store: IdempotencyStore
    ) -> None:
        req = request(deterministic=False)
        await idempotency_store.begin(WS, "key-1", "fp", 1.0)
        assert await idempotency_store.abandon(WS, "key-1", 1.5)
        completion = KeyCompletion[Enqueued](WS, "key-1", "fp", lambda a: StoredResponse(202, {}))
        with pytest.raises(IdempotencyKeyLost):
            await store.enqueue(req, 2.0, idempotency=completion)
        assert await store.get(WS, req.request_id) is None
