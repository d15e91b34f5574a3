"""The queue's batched enqueue (`QueueStore.enqueue_many`, docs/queue.md "Enqueueing many"),
written once and run against every backend.

A backend's queue test class mixes `EnqueueManyContract` in next to `QueueContract`, whose
fixtures (`store`, `peer_store`, `idempotency_store`) it uses.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from cv_server.queue import (
    EnqueueAsk,
    Enqueued,
    IdempotencyKeyLost,
    IdempotencyStore,
    KeyCompletion,
    Owned,
    ProcessRequest,
    QueueStore,
    RequestEvent,
    RequestIdConflict,
    StoredAnswer,
    StoredResponse,
)
from cv_server.queue.model import new_row
from tests.contract.queue_contract import LEASE, OTHER_WS, STAGE, WS, request


def asks(*jobs: str) -> list[EnqueueAsk]:
    return [EnqueueAsk(request(job)) for job in jobs]


async def finished(store: QueueStore, job: str, now: float) -> ProcessRequest:
    """`job` enqueued, claimed and done by `now`."""
    await store.enqueue(request(job), now)
    held = await store.claim(STAGE, "w1", LEASE, now)
    assert held is not None
    assert held.claim_token is not None
    return await store.complete(held.request_id, held.claim_token, {"job": job}, now)


class EnqueueManyContract:
    """A batch of enqueues commits at once and answers each item as a single enqueue would."""

    async def test_each_item_is_answered_in_order_with_the_id_a_single_enqueue_mints(
        self, store: QueueStore
    ) -> None:
        batch = [*asks("c", "a", "b"), EnqueueAsk(request("r", deterministic=False))]
        answers = await store.enqueue_many(batch, 5.0)
        assert [a.row.request_id for a in answers] == [i.request.request_id for i in batch]
        assert [a.coalesced for a in answers] == [False] * 4
        for item, answer in zip(batch, answers, strict=True):
            assert answer.row == new_row(item.request, 5.0)  # what `enqueue` makes of it
            assert await store.get(WS, answer.row.request_id) == answer.row

    async def test_a_duplicate_within_the_batch_coalesces_into_the_row_its_first_item_made(
        self, store: QueueStore
    ) -> None:
        first = EnqueueAsk(request("a", input={"v": 1}))
        again = EnqueueAsk(request("a", input={"v": 2}), rerun=True)  # live: rerun changes nothing
        answers = await store.enqueue_many([first, *asks("b"), again], 1.0)
        assert [a.coalesced for a in answers] == [False, False, True]
        assert answers[2] == Enqueued(answers[0].row, coalesced=True)
        assert answers[2].row.input == {"v": 1}
        assert len(await store.list(workspace_id=WS)) == 2

    async def test_rows_stored_before_are_answered_as_single_enqueues_answer_them(
        self, store: QueueStore
    ) -> None:
        done = await finished(store, "done", 1.0)
        live, _ = await store.enqueue(request("live"), 2.0)
        answers = await store.enqueue_many(
            [
                EnqueueAsk(request("live", input={"other": 1})),
                EnqueueAsk(request("done")),  # a plain re-enqueue is answered by the result
                EnqueueAsk(request("done", input={"v": 2}), rerun=True),  # re-opened on purpose
                EnqueueAsk(request("done"), rerun=True),  # now live: coalesces
                EnqueueAsk(request("new")),
            ],
            3.0,
        )
        assert answers[0] == Enqueued(live, coalesced=True)
        assert answers[1] == Enqueued(done, coalesced=True)
        reopened = answers[2].row
        assert not answers[2].coalesced
        assert (reopened.request_id, reopened.status, reopened.run) == (
            done.request_id,
            "pending",
            2,
        )
        assert (reopened.input, reopened.result, reopened.created_at) == ({"v": 2}, None, 3.0)
        assert answers[3] == Enqueued(reopened, coalesced=True)
        assert answers[4] == Enqueued(new_row(request("new"), 3.0), coalesced=False)
        assert await store.get(WS, done.request_id) == reopened

    async def test_a_retried_batch_is_answered_as_duplicates_and_writes_nothing(
        self, store: QueueStore
    ) -> None:
        batch = asks("a", "b", "c")
        first = await store.enqueue_many(batch, 1.0)
        heard: list[RequestEvent] = []
        store.add_listener(heard.append)
        retried = await store.enqueue_many(batch, 2.0)
        assert retried == [Enqueued(a.row, coalesced=True) for a in first]
        assert heard == []
        assert len(await store.list(workspace_id=WS)) == 3

    async def test_a_refused_item_refuses_the_whole_batch_and_nothing_is_written(
        self, store: QueueStore
    ) -> None:
        theirs, _ = await store.enqueue(request("x", ws=OTHER_WS), 1.0)
        conflicting = dataclasses.replace(request("x"), request_id=theirs.request_id)
        heard: list[RequestEvent] = []
        store.add_listener(heard.append)
        with pytest.raises(RequestIdConflict):
            await store.enqueue_many(
                [*asks("a"), EnqueueAsk(conflicting), *asks("c")],
                2.0,
            )
        assert await store.list(workspace_id=WS) == []
        assert await store.get(OTHER_WS, theirs.request_id) == theirs
        assert heard == []

    async def test_each_new_row_is_announced_once_after_the_commit(
        self, store: QueueStore, peer_store: QueueStore
    ) -> None:
        await store.enqueue(request("old"), 1.0)
        heard: list[RequestEvent] = []
        observed: list[RequestEvent] = []
        reads: list[asyncio.Task[ProcessRequest | None]] = []

        def listener(event: RequestEvent) -> None:
            heard.append(event)
            # Through another connection: only what committed is readable there.
            reads.append(
                asyncio.ensure_future(peer_store.get(event.workspace_id, event.request_id))
            )

        store.add_listener(listener)
        store.add_observer(observed.append)
        answers = await store.enqueue_many(asks("b", "old", "a", "b"), 2.0)
        new = [answers[0].row, answers[2].row]
        assert [(e.request_id, e.status, e.run) for e in heard] == [
            (row.request_id, "pending", 1) for row in new
        ]
        assert [(e.request_id, e.kind) for e in observed] == [
            (row.request_id, "enqueued") for row in new
        ]
        assert await asyncio.gather(*reads) == new

    async def test_the_rows_of_a_batch_are_claimed_in_batch_order(self, store: QueueStore) -> None:
        answers = await store.enqueue_many(asks("c", "a", "d", "b"), 1.0)
        claimed = await store.claim_many(STAGE, "w1", LEASE, 2.0, limit=4)
        assert [row.request_id for row in claimed] == [a.row.request_id for a in answers]
        listed = await store.list(workspace_id=WS)
        assert [row.request_id for row in listed] == [a.row.request_id for a in answers]

    async def test_a_batch_given_no_time_is_stamped_once_on_the_store_clock(
        self, store: QueueStore
    ) -> None:
        before = await store.clock()
        answers = await store.enqueue_many(asks("a", "b", "c"), None)
        after = await store.clock()
        stamps = {(a.row.created_at, a.row.available_at) for a in answers}
        assert len(stamps) == 1
        ((created, available),) = stamps
        assert before <= created == available <= after
        again = await store.enqueue_many(asks("a"), None)
        assert again == [Enqueued(answers[0].row, coalesced=True)]

    async def test_an_empty_batch_writes_nothing(self, store: QueueStore) -> None:
        assert await store.enqueue_many([], 1.0) == []
        assert await store.list() == []

    async def test_concurrent_overlapping_batches_make_one_row_per_id(
        self, store: QueueStore, peer_store: QueueStore
    ) -> None:
        jobs = [f"j{i}" for i in range(8)]
        results = await asyncio.gather(
            *(
                (store if i % 2 else peer_store).enqueue_many(
                    asks(*(jobs if i % 2 else reversed(jobs))), 1.0
                )
                for i in range(10)
            )
        )
        answers = [answer for batch in results for answer in batch]
        made = [a.row.request_id for a in answers if not a.coalesced]
        assert sorted(made) == sorted(request(job).request_id for job in jobs)
        assert len(await store.list(workspace_id=WS)) == len(jobs)

    async def test_a_batch_completes_its_idempotency_key_in_the_same_transaction(
        self, store: QueueStore, idempotency_store: IdempotencyStore
    ) -> None:
        assert isinstance(await idempotency_store.begin(WS, "key-1", "fp", 1.0), Owned)

        def respond(answers: list[Enqueued]) -> StoredResponse:
            return StoredResponse(202, [a.row.request_id for a in answers])

        completion = KeyCompletion[list[Enqueued]](WS, "key-1", "fp", respond)
        batch = [EnqueueAsk(request("r", deterministic=False)), *asks("a")]
        answers = await store.enqueue_many(batch, 1.0, idempotency=completion)
        replay = await idempotency_store.begin(WS, "key-1", "fp", 2.0)
        assert replay == StoredAnswer(202, [a.row.request_id for a in answers])

    async def test_a_batch_whose_idempotency_key_was_lost_is_rolled_back(
        self, store: QueueStore, idempotency_store: IdempotencyStore
    ) -> None:
        await idempotency_store.begin(WS, "key-1", "fp", 1.0)
        assert await idempotency_store.abandon(WS, "key-1", 1.5)
        completion = KeyCompletion[list[Enqueued]](
            WS, "key-1", "fp", lambda a: StoredResponse(202, {})
        )
        heard: list[RequestEvent] = []
        store.add_listener(heard.append)
        # The key is completed after the rows were written in the same transaction.
        with pytest.raises(IdempotencyKeyLost):
            await store.enqueue_many(asks("a", "b"), 2.0, idempotency=completion)
        assert await store.list() == []
        assert heard == []
