"""Concurrency keys (docs/queue.md, "Concurrency keys"), written once and run against every
backend: a claim never hands out a row whose key already runs its `max_running_per_key`, rows a
key holds back never stand in the way of other keys, and a lapsed lease frees its slot.

A backend's test class subclasses `ConcurrencyKeysContract` beside `QueueContract`, whose
`store` and `peer_store` (a second connection, as a second server process would have) it uses.
Time is passed in: leases lapse without waiting on any clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter

import pytest

from cv_server.queue import ClaimAsk, Completion, NewRequest, ProcessRequest, QueueStore
from tests.contract.queue_contract import LEASE, OTHER_WS, STAGE, WS, request

#: Keys, rows per key, and the limit of the race test.
KEYS = 10
ROWS_PER_KEY = 6
LIMIT = 2


def keyed(job: str, key: str | None, limit: int | None, *, ws: str = WS) -> NewRequest:
    return dataclasses.replace(request(job, ws=ws), concurrency_key=key, max_running_per_key=limit)


def ids(rows: list[ProcessRequest]) -> list[str | None]:
    return [row.input["job"] for row in rows]


def job(row: ProcessRequest | None) -> str | None:
    return None if row is None else row.input["job"]


def held(row: ProcessRequest | None) -> ProcessRequest:
    assert row is not None
    assert row.claim_token is not None
    return row


class ConcurrencyKeysContract:
    """What every backend keeps for concurrency keys."""

    async def test_a_key_runs_at_most_its_limit_at_once(self, store: QueueStore) -> None:
        for i in range(4):
            await store.enqueue(keyed(f"a{i}", "k", 2), float(i))
        first = held(await store.claim(STAGE, "w1", LEASE, 10.0))
        assert job(await store.claim(STAGE, "w2", LEASE, 10.0)) == "a1"
        assert await store.claim(STAGE, "w3", LEASE, 10.0) is None
        await store.complete(first.request_id, first.claim_token or "", {"ok": True}, 11.0)
        third = held(await store.claim(STAGE, "w3", LEASE, 12.0))
        assert job(third) == "a2"
        assert (third.concurrency_key, third.max_running_per_key) == ("k", 2)

    async def test_rows_held_back_by_their_key_do_not_block_other_keys(
        self, store: QueueStore
    ) -> None:
        for i in range(5):
            await store.enqueue(keyed(f"a{i}", "a", 1), float(i))
        await store.enqueue(keyed("b0", "b", 1), 10.0)
        await store.enqueue(keyed("plain", None, None), 11.0)
        claimed = await store.claim_many(STAGE, "w", LEASE, 20.0, limit=10)
        assert ids(claimed) == ["a0", "b0", "plain"]
        assert await store.claim(STAGE, "w", LEASE, 20.0) is None

    async def test_a_batch_claim_takes_no_more_of_a_key_than_its_limit(
        self, store: QueueStore
    ) -> None:
        for i in range(5):
            await store.enqueue(keyed(f"a{i}", "a", 2), float(i))
        assert ids(await store.claim_many(STAGE, "w", LEASE, 20.0, limit=5)) == ["a0", "a1"]
        assert await store.claim_many(STAGE, "w", LEASE, 20.0, limit=5) == []

    async def test_among_keys_the_oldest_claimable_row_goes_first(self, store: QueueStore) -> None:
        for i, (name, key) in enumerate((("a0", "a"), ("a1", "a"), ("b0", "b"), ("a2", "a"))):
            await store.enqueue(keyed(name, key, 1), float(i))
        order = [job(await store.claim(STAGE, "w", LEASE, 10.0)) for _ in range(3)]
        assert order == ["a0", "b0", None]

    async def test_each_row_is_held_to_its_own_limit(self, store: QueueStore) -> None:
        await store.enqueue(keyed("wide", "k", 3), 1.0)
        await store.enqueue(keyed("narrow", "k", 1), 2.0)
        await store.enqueue(keyed("wide-too", "k", 3), 3.0)
        # One of the key runs: the narrow row (limit 1) waits, the later wide one (limit 3) runs.
        assert ids(await store.claim_many(STAGE, "w", LEASE, 10.0, limit=1)) == ["wide"]
        assert ids(await store.claim_many(STAGE, "w", LEASE, 10.0, limit=5)) == ["wide-too"]

    async def test_a_row_with_a_key_and_no_limit_runs_but_takes_a_slot(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(keyed("free", "k", None), 1.0)
        await store.enqueue(keyed("limited", "k", 1), 2.0)
        assert ids(await store.claim_many(STAGE, "w", LEASE, 10.0, limit=5)) == ["free"]
        assert await store.claim(STAGE, "w", LEASE, 10.0) is None

    async def test_keys_of_different_workspaces_are_different_keys(self, store: QueueStore) -> None:
        await store.enqueue(keyed("mine", "k", 1), 1.0)
        await store.enqueue(keyed("theirs", "k", 1, ws=OTHER_WS), 2.0)
        assert ids(await store.claim_many(STAGE, "w", LEASE, 10.0, limit=5)) == ["mine", "theirs"]

    async def test_a_lapsed_lease_frees_its_slot_and_its_takeover_counts_once(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(keyed("a0", "k", 1), 1.0)
        await store.enqueue(keyed("a1", "k", 1), 2.0)
        assert job(await store.claim(STAGE, "dies", LEASE, 10.0)) == "a0"
        assert await store.claim(STAGE, "w", LEASE, 10.0 + LEASE) is None  # at the instant: held
        later = 11.0 + LEASE
        # The lease lapsed: its slot is free, and a1 (claimable since 2.0) is the oldest.
        taken = held(await store.claim(STAGE, "w", LEASE, later))
        assert job(taken) == "a1"
        # a0 is claimable again, but its key runs a1 now.
        assert await store.claim(STAGE, "w", LEASE, later) is None
        assert not await store.has_claimable(STAGE, later)
        await store.complete(taken.request_id, taken.claim_token or "", None, later + 1)
        again = held(await store.claim(STAGE, "w", LEASE, later + 2))
        assert job(again) == "a0"
        assert again.dequeue_count == 2
        assert await store.claim(STAGE, "w", LEASE, later + 2) is None

    async def test_a_completion_frees_its_slot_for_the_claim_sent_with_it(
        self, store: QueueStore
    ) -> None:
        await store.enqueue(keyed("a0", "k", 1), 1.0)
        await store.enqueue(keyed("a1", "k", 1), 2.0)
        first = held(await store.claim(STAGE, "w", LEASE, 10.0))
        then = await store.complete_then_claim(
            [Completion(first.request_id, first.claim_token or "", None)],
            11.0,
            claim_next=ClaimAsk(STAGE, "w", LEASE),
        )
        assert ids(then.claimed) == ["a1"]

    async def test_only_rows_a_claim_would_take_are_claimable(self, store: QueueStore) -> None:
        await store.enqueue(keyed("a0", "k", 1), 1.0)
        await store.enqueue(keyed("a1", "k", 1), 2.0)
        assert await store.has_claimable(STAGE, 10.0)
        assert await store.claim(STAGE, "w", LEASE, 10.0) is not None
        assert not await store.has_claimable(STAGE, 10.0)
        await store.enqueue(keyed("b0", "other", 1), 3.0)
        assert await store.has_claimable(STAGE, 10.0)

    async def test_held_by_key_counts_the_rows_their_key_holds_back(
        self, store: QueueStore
    ) -> None:
        for i in range(4):
            await store.enqueue(keyed(f"a{i}", "k", 1), float(i))
        await store.enqueue(keyed("plain", None, None), 5.0)
        assert await store.held_by_key(10.0) == 0
        assert await store.claim(STAGE, "w", LEASE, 10.0) is not None
        assert await store.held_by_key(10.0) == 3
        assert await store.held_by_key(10.0 + LEASE + 1) == 0  # the lease lapsed: slot free
        assert await store.held_by_key(None) in (0, 3)  # the store's clock: just a number

    @pytest.mark.parametrize("limit", [1, 3])
    async def test_claimers_on_two_connections_never_exceed_a_keys_limit(
        self, store: QueueStore, peer_store: QueueStore, limit: int
    ) -> None:
        for k in range(KEYS):
            for i in range(ROWS_PER_KEY):
                await store.enqueue(keyed(f"k{k}-{i}", f"key-{k}", LIMIT), float(i))
        await store.enqueue(keyed("plain", None, None), 0.5)
        # Every claimer at once, half on each connection, each asking for `limit` rows.
        claims = await asyncio.gather(
            *(
                (store if i % 2 else peer_store).claim_many(
                    STAGE, f"w{i}", LEASE, 100.0, limit=limit
                )
                for i in range(KEYS * ROWS_PER_KEY)
            )
        )
        won = [row for rows in claims for row in rows]
        assert len({row.request_id for row in won}) == len(won)
        running = Counter(row.concurrency_key for row in won)
        assert running.pop(None) == 1
        assert max(running.values()) <= LIMIT
        # Nothing was left out for good: what a key may still run, a later claim takes.
        rest = await store.claim_many(STAGE, "late", LEASE, 100.0, limit=KEYS * ROWS_PER_KEY)
        running.update(row.concurrency_key for row in rest)
        assert running == {f"key-{k}": LIMIT for k in range(KEYS)}
