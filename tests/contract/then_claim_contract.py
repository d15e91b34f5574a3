"""The queue's report-then-claim verbs (`QueueStore.complete_then_claim`, `fail_then_claim`;
docs/queue.md "One round trip per job"), written once and run against every backend.

A backend's queue test class mixes `ThenClaimContract` in next to `QueueContract` and adds one
fixture, `unbindable_store`: a store on the same database whose claim tokens the database cannot
store, so a claim fails inside the transaction after the report in it was written.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from cv_server.queue import (
    ClaimAsk,
    Completion,
    LeaseLost,
    ProcessRequest,
    QueueStore,
    RequestNotFound,
)
from tests.contract.queue_contract import BACKOFF, LEASE, OTHER_WS, STAGE, WS, request

ASK = ClaimAsk(STAGE, "w1", LEASE)


async def held(store: QueueStore, now: float, limit: int = 1) -> list[ProcessRequest]:
    rows = await store.claim_many(STAGE, "w1", LEASE, now, limit=limit)
    assert len(rows) == limit
    return rows


def token(row: ProcessRequest) -> str:
    assert row.claim_token is not None
    return row.claim_token


class ThenClaimContract:
    """A report and the next claim commit together, under the claim rules of `claim_many`."""

    @pytest.fixture
    async def unbindable_store(self, store: QueueStore) -> AsyncIterator[QueueStore]:
        raise NotImplementedError("a backend's test class provides it")
        yield  # noqa: PT022 - an async generator, like the overrides

    async def test_complete_then_claim_finishes_the_row_and_claims_the_next(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request("a"), 1.0)
        await store.enqueue(request("b"), 2.0)
        (a,) = await held(store, 3.0)
        outcomes, claimed = await store.complete_then_claim(
            [Completion(a.request_id, token(a), {"v": 1})], 4.0, claim_next=ASK
        )
        (done,) = outcomes
        assert isinstance(done, ProcessRequest)
        assert (done.status, done.result) == ("done", {"v": 1})
        (b,) = claimed
        assert b.job_id == "b"
        assert (b.status, b.claimed_by, b.claimed_at) == ("in_progress", "w1", 4.0)
        assert (b.lease_expires_at, b.dequeue_count) == (4.0 + LEASE, 1)
        assert b.claim_token not in (None, a.claim_token)
        assert await store.get(WS, b.request_id) == b
        assert await store.get(WS, a.request_id) == done
        # The fresh token fences the new row like any claim's.
        finished = await store.complete(b.request_id, token(b), {"v": 2}, 5.0)
        assert finished.status == "done"

    async def test_a_refused_completion_does_not_stop_the_claim_nor_the_others(
        self, store: QueueStore
    ) -> None:
        for i, job in enumerate("abc"):
            await store.enqueue(request(job), float(i))
        a, b = await held(store, 3.0, limit=2)
        b_before = await store.get(WS, b.request_id)
        outcomes, claimed = await store.complete_then_claim(
            [
                Completion(b.request_id, "stale-token", {"v": "b"}),
                Completion("d_missing", "t"),
                Completion(a.request_id, token(a), {"v": "a"}),
            ],
            4.0,
            claim_next=ASK,
        )
        refused, missing, done = outcomes
        assert isinstance(refused, LeaseLost)
        assert isinstance(missing, RequestNotFound)
        assert isinstance(done, ProcessRequest)
        assert done.status == "done"
        assert await store.get(WS, b.request_id) == b_before
        assert [row.job_id for row in claimed] == ["c"]

    async def test_a_refused_fail_does_not_stop_the_claim(self, store: QueueStore) -> None:
        await store.enqueue(request("a"), 1.0)
        await store.enqueue(request("b"), 2.0)
        (a,) = await held(store, 3.0)
        outcomes, claimed = await store.fail_then_claim(
            a.request_id, "stale-token", {"code": "x"}, BACKOFF, 4.0, claim_next=ASK
        )
        (refused,) = outcomes
        assert isinstance(refused, LeaseLost)
        assert await store.get(WS, a.request_id) == a
        assert [row.job_id for row in claimed] == ["b"]
        outcomes, claimed = await store.fail_then_claim(
            "d_missing", "t", {"code": "x"}, BACKOFF, 5.0, claim_next=ASK
        )
        assert isinstance(outcomes[0], RequestNotFound)
        assert claimed == []

    async def test_fail_then_claim_backs_off_the_row_and_claims_the_next(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request("a"), 1.0)
        await store.enqueue(request("b"), 2.0)
        (a,) = await held(store, 3.0)
        outcomes, claimed = await store.fail_then_claim(
            a.request_id, token(a), {"code": "boom"}, BACKOFF, 4.0, claim_next=ASK
        )
        (failed,) = outcomes
        assert isinstance(failed, ProcessRequest)
        assert (failed.status, failed.available_at, failed.error) == (
            "pending",
            4.0 + BACKOFF,
            {"code": "boom"},
        )
        assert [row.job_id for row in claimed] == ["b"]  # not the backed-off one
        assert await store.get(WS, a.request_id) == failed

    async def test_the_claim_takes_at_most_its_limit_oldest_first(self, store: QueueStore) -> None:
        for i in range(5):
            await store.enqueue(request(f"job-{i}"), float(i))
        (first,) = await held(store, 10.0)
        _, claimed = await store.complete_then_claim(
            [Completion(first.request_id, token(first))],
            11.0,
            claim_next=ClaimAsk(STAGE, "w1", LEASE, limit=3),
        )
        assert [row.job_id for row in claimed] == ["job-1", "job-2", "job-3"]
        assert len({row.claim_token for row in claimed}) == 3
        pending = await store.list(status="pending")
        assert [row.job_id for row in pending] == ["job-4"]

    async def test_the_claim_is_restricted_to_the_allowed_workspaces_and_classes(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(request("mine"), 1.0)
        await store.enqueue(request("theirs", ws=OTHER_WS), 0.5)
        await store.enqueue(request("other-class", worker_class="gpu"), 0.1)
        await store.enqueue(request("next"), 2.0)
        (mine,) = await store.claim_many(STAGE, "w1", LEASE, 3.0, limit=1, workspace_ids=[WS])
        assert mine.job_id == "mine"
        ask = ClaimAsk(STAGE, "w1", LEASE, limit=5, workspace_ids=[WS])
        _, claimed = await store.complete_then_claim(
            [Completion(mine.request_id, token(mine))], 4.0, claim_next=ask
        )
        assert [row.job_id for row in claimed] == ["next"]
        nowhere = ClaimAsk(STAGE, "w1", LEASE, workspace_ids=[])
        outcomes, claimed = await store.fail_then_claim(
            claimed[0].request_id, token(claimed[0]), {"e": 1}, BACKOFF, 5.0, claim_next=nowhere
        )
        assert isinstance(outcomes[0], ProcessRequest)
        assert outcomes[0].status == "pending"
        assert claimed == []

    async def test_a_bad_ask_is_refused_before_anything_is_written(self, store: QueueStore) -> None:
        await store.enqueue(request("a"), 1.0)
        await store.enqueue(request("b"), 2.0)
        (a,) = await held(store, 3.0)
        bad = [
            (ClaimAsk(STAGE, "w1", LEASE, limit=0), "limit"),
            (ClaimAsk(STAGE, "w1", -1.0), "lease"),
        ]
        for ask, what in bad:
            with pytest.raises(ValueError, match=what):
                await store.complete_then_claim(
                    [Completion(a.request_id, token(a))], 4.0, claim_next=ask
                )
            with pytest.raises(ValueError, match=what):
                await store.fail_then_claim(a.request_id, token(a), None, 0, 4.0, claim_next=ask)
        with pytest.raises(ValueError, match="backoff"):
            await store.fail_then_claim(a.request_id, token(a), None, -1.0, 4.0, claim_next=ASK)
        assert await store.get(WS, a.request_id) == a
        assert [row.job_id for row in await store.list(status="pending")] == ["b"]

    async def test_a_claim_that_fails_mid_transaction_leaves_the_report_unwritten(
        self, store: QueueStore, unbindable_store: QueueStore
    ) -> None:
        await store.enqueue(request("a"), 1.0)
        await store.enqueue(request("b"), 2.0)
        (a,) = await held(store, 3.0)
        b_before = await store.get(WS, request("b").request_id)
        heard: list[str] = []
        unbindable_store.add_listener(lambda event: heard.append(event.status))
        with pytest.raises(Exception):  # noqa: B017, PT011 - the database's own binding error
            await unbindable_store.complete_then_claim(
                [Completion(a.request_id, token(a), {"v": 1})], 4.0, claim_next=ASK
            )
        with pytest.raises(Exception):  # noqa: B017, PT011
            await unbindable_store.fail_then_claim(
                a.request_id, token(a), {"e": 1}, BACKOFF, 4.0, claim_next=ASK
            )
        assert await store.get(WS, a.request_id) == a  # neither done nor failed
        assert await store.get(WS, request("b").request_id) == b_before  # nor claimed
        assert heard == []  # and nothing announced
        # The same report with a claim that works commits both.
        outcomes, claimed = await store.complete_then_claim(
            [Completion(a.request_id, token(a), {"v": 1})], 5.0, claim_next=ASK
        )
        assert isinstance(outcomes[0], ProcessRequest)
        assert outcomes[0].status == "done"
        assert [row.job_id for row in claimed] == ["b"]

    async def test_racing_workers_on_two_connections_never_share_a_row(
        self, store: QueueStore, peer_store: QueueStore
    ) -> None:
        backlog, workers = 40, 6
        for i in range(backlog):
            await store.enqueue(request(f"job-{i}"), float(i))
        runs: dict[str, list[str]] = {}

        async def worker(n: int) -> None:
            mine = peer_store if n % 2 else store
            name = f"w{n}"
            ask = ClaimAsk(STAGE, name, LEASE, limit=1 + n % 3)
            rows = await mine.claim_many(STAGE, name, LEASE, 100.0, limit=ask.limit)
            while rows:
                for row in rows:
                    runs.setdefault(row.request_id, []).append(name)
                outcomes, rows = await mine.complete_then_claim(
                    [Completion(row.request_id, token(row), {"by": name}) for row in rows],
                    100.0,
                    claim_next=ask,
                )
                assert all(isinstance(o, ProcessRequest) for o in outcomes), outcomes

        await asyncio.gather(*(worker(n) for n in range(workers)))
        assert len(runs) == backlog
        assert all(len(names) == 1 for names in runs.values()), runs
        done = await store.list(status="done", limit=backlog + 1)
        assert len(done) == backlog
        assert all(row.result == {"by": runs[row.request_id][0]} for row in done)
