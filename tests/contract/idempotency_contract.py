"""The idempotency-key contract (docs/queue.md), written once and run against every backend.

A backend's test class subclasses `IdempotencyContract` and overrides the `store` fixture, built
with `RETENTION` as its retention, and the `kill_owner` fixture: `await kill_owner(ws, key)` makes
the owner of a key die for real, as a crash of its server would (no mock), and `new_store`: a
callable that builds another store of the backend on the same database from constructor keywords
(`retention=`), closed at teardown. Time is passed explicitly: expiry needs no clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from cv_server.config import ServerConfig
from cv_server.queue import (
    IdempotencyKeyLost,
    IdempotencyStore,
    InProgress,
    Mismatch,
    Owned,
    StoredAnswer,
    StoredResponse,
    request_fingerprint,
)

RETENTION = ServerConfig().idempotency_retention_seconds
WS = "tenant-a"
OTHER_WS = "tenant-b"
KEY = "key-abc"
FP = request_fingerprint("POST", "/v1/workspaces/tenant-a/requests", b'{"stage":"scrape"}')
OTHER_FP = request_fingerprint("POST", "/v1/workspaces/tenant-a/requests", b'{"stage":"other"}')
CONCURRENT = 40

KillOwner = Callable[[str, str], Awaitable[None]]
#: `new_store(**constructor_keywords)`: another store of the backend on the test's database.
NewStore = Callable[..., IdempotencyStore]


class IdempotencyContract:
    """Every `IdempotencyStore` keeps these rules."""

    @pytest.fixture
    async def store(self) -> AsyncIterator[IdempotencyStore]:
        raise NotImplementedError("a backend's test class provides the store")
        yield  # noqa: PT022 - an async generator, like the overrides

    @pytest.fixture
    def kill_owner(self, store: IdempotencyStore) -> KillOwner:
        raise NotImplementedError("a backend's test class says how an owner dies")

    @pytest.fixture
    async def new_store(self) -> AsyncIterator[NewStore]:
        raise NotImplementedError("a backend's test class provides new_store")
        yield  # noqa: PT022 - an async generator, like the overrides

    def test_a_retention_that_is_not_positive_is_refused(self, new_store: NewStore) -> None:
        with pytest.raises(ValueError, match="retention"):
            new_store(retention=0)

    async def test_the_first_request_owns_a_new_key(self, store: IdempotencyStore) -> None:
        assert await store.begin(WS, KEY, FP, 1.0) == Owned()

    async def test_exactly_one_of_many_concurrent_first_requests_owns_the_key(
        self, store: IdempotencyStore
    ) -> None:
        outcomes = await asyncio.gather(*(store.begin(WS, KEY, FP, 1.0) for _ in range(CONCURRENT)))
        assert outcomes.count(Owned()) == 1
        assert outcomes.count(InProgress()) == CONCURRENT - 1

    async def test_a_retry_while_the_first_request_runs_is_told_it_is_in_progress(
        self, store: IdempotencyStore
    ) -> None:
        await store.begin(WS, KEY, FP, 1.0)
        assert await store.begin(WS, KEY, FP, 2.0) == InProgress()

    async def test_a_retry_after_completion_replays_the_stored_answer_verbatim(
        self, store: IdempotencyStore
    ) -> None:
        body = {"request_id": "r_1", "status": "pending", "nested": {"é": [1, None]}}
        await store.begin(WS, KEY, FP, 1.0)
        await store.finish(WS, KEY, FP, StoredResponse(202, body), 2.0)
        assert await store.begin(WS, KEY, FP, 3.0) == StoredAnswer(202, body)
        assert await store.begin(WS, KEY, FP, 4.0) == StoredAnswer(202, body)

    async def test_a_key_reused_for_another_request_is_a_mismatch_in_any_state(
        self, store: IdempotencyStore
    ) -> None:
        await store.begin(WS, KEY, FP, 1.0)
        assert await store.begin(WS, KEY, OTHER_FP, 2.0) == Mismatch()
        await store.finish(WS, KEY, FP, StoredResponse(202, {"ok": 1}), 3.0)
        assert await store.begin(WS, KEY, OTHER_FP, 4.0) == Mismatch()
        assert await store.begin(WS, KEY, FP, 5.0) == StoredAnswer(202, {"ok": 1})

    async def test_keys_are_scoped_to_the_workspace(self, store: IdempotencyStore) -> None:
        await store.begin(WS, KEY, FP, 1.0)
        await store.finish(WS, KEY, FP, StoredResponse(202, {"secret": "of tenant a"}), 2.0)
        # Tenant B sends the same key with the very same bytes: it gets its own key, never A's
        # stored answer.
        assert await store.begin(OTHER_WS, KEY, FP, 3.0) == Owned()
        await store.finish(OTHER_WS, KEY, FP, StoredResponse(201, {"mine": "b"}), 4.0)
        assert await store.begin(OTHER_WS, KEY, FP, 5.0) == StoredAnswer(201, {"mine": "b"})
        assert await store.begin(WS, KEY, FP, 5.0) == StoredAnswer(202, {"secret": "of tenant a"})

    async def test_an_abandoned_key_lets_a_retry_run(self, store: IdempotencyStore) -> None:
        await store.begin(WS, KEY, FP, 1.0)
        assert await store.abandon(WS, KEY, 2.0)
        assert await store.begin(WS, KEY, FP, 3.0) == Owned()

    async def test_a_completed_key_is_never_abandoned(self, store: IdempotencyStore) -> None:
        await store.begin(WS, KEY, FP, 1.0)
        await store.finish(WS, KEY, FP, StoredResponse(202, {"ok": 1}), 2.0)
        assert not await store.abandon(WS, KEY, 3.0)
        assert not await store.abandon(WS, "never-used", 3.0)
        assert await store.begin(WS, KEY, FP, 4.0) == StoredAnswer(202, {"ok": 1})

    async def test_finishing_a_key_nobody_owns_is_refused(self, store: IdempotencyStore) -> None:
        with pytest.raises(IdempotencyKeyLost):
            await store.finish(WS, KEY, FP, StoredResponse(202, {}), 1.0)
        await store.begin(WS, KEY, FP, 1.0)
        with pytest.raises(IdempotencyKeyLost):  # owned under another fingerprint
            await store.finish(WS, KEY, OTHER_FP, StoredResponse(202, {}), 2.0)
        await store.finish(WS, KEY, FP, StoredResponse(202, {}), 2.0)
        with pytest.raises(IdempotencyKeyLost):  # already completed
            await store.finish(WS, KEY, FP, StoredResponse(500, {}), 3.0)
        assert await store.begin(WS, KEY, FP, 4.0) == StoredAnswer(202, {})

    async def test_a_key_expires_after_the_retention_even_before_the_sweep(
        self, store: IdempotencyStore
    ) -> None:
        await store.begin(WS, KEY, FP, 0.0)
        await store.finish(WS, KEY, FP, StoredResponse(202, {"old": 1}), 1.0)
        assert await store.begin(WS, KEY, FP, RETENTION - 0.5) == StoredAnswer(202, {"old": 1})
        # Retention counts from the first use; after it the key is free, whatever it held.
        assert await store.begin(WS, KEY, OTHER_FP, RETENTION) == Owned()
        assert await store.begin(WS, KEY, OTHER_FP, RETENTION + 1) == InProgress()

    async def test_the_sweep_deletes_expired_keys_only(self, store: IdempotencyStore) -> None:
        for i in range(5):
            old = await store.begin(WS, f"old-{i}", FP, 0.0)
            assert isinstance(old, Owned)
            await old.release()  # their owners are long gone by the time they expire
        await store.begin(WS, "young", FP, 100.0)
        assert await store.sweep(RETENTION, limit=2) == 2
        assert await store.sweep(RETENTION) == 3
        assert await store.sweep(RETENTION) == 0
        assert await store.begin(WS, "young", FP, RETENTION) == InProgress()
        with pytest.raises(ValueError, match="limit"):
            await store.sweep(RETENTION, limit=-1)

    # -- owners that die (a crashed request must not leave 24 h of 409) -----------

    async def test_a_key_whose_owner_died_is_taken_over_by_exactly_one_of_many_retries(
        self, store: IdempotencyStore, kill_owner: KillOwner
    ) -> None:
        assert await store.begin(WS, KEY, FP, 1.0) == Owned()
        await kill_owner(WS, KEY)
        outcomes = await asyncio.gather(*(store.begin(WS, KEY, FP, 2.0) for _ in range(CONCURRENT)))
        assert outcomes.count(Owned()) == 1
        assert outcomes.count(InProgress()) == CONCURRENT - 1
        # The taker owns the key for real: it completes it, and retries replay its answer.
        await store.finish(WS, KEY, FP, StoredResponse(202, {"taken": "over"}), 3.0)
        assert await store.begin(WS, KEY, FP, 4.0) == StoredAnswer(202, {"taken": "over"})

    async def test_a_key_whose_owner_is_alive_still_answers_in_progress(
        self, store: IdempotencyStore
    ) -> None:
        owned = await store.begin(WS, KEY, FP, 1.0)
        outcomes = await asyncio.gather(*(store.begin(WS, KEY, FP, 2.0) for _ in range(CONCURRENT)))
        assert outcomes == [InProgress()] * CONCURRENT
        assert isinstance(owned, Owned)
        await store.finish(WS, KEY, FP, StoredResponse(202, {"ok": 1}), 3.0)
        assert await store.begin(WS, KEY, FP, 4.0) == StoredAnswer(202, {"ok": 1})

    async def test_a_finished_key_is_released_and_never_taken_over(
        self, store: IdempotencyStore
    ) -> None:
        owned = await store.begin(WS, KEY, FP, 1.0)
        await store.finish(WS, KEY, FP, StoredResponse(202, {"ok": 1}), 2.0)
        outcomes = await asyncio.gather(*(store.begin(WS, KEY, FP, 3.0) for _ in range(CONCURRENT)))
        assert outcomes == [StoredAnswer(202, {"ok": 1})] * CONCURRENT
        assert isinstance(owned, Owned)
        await owned.release()  # idempotent after finish
        assert await store.begin(WS, KEY, FP, 4.0) == StoredAnswer(202, {"ok": 1})

    async def test_an_abandoned_key_is_released_to_exactly_one_retry(
        self, store: IdempotencyStore
    ) -> None:
        owned = await store.begin(WS, KEY, FP, 1.0)
        assert await store.abandon(WS, KEY, 2.0)
        assert isinstance(owned, Owned)
        await owned.release()
        outcomes = await asyncio.gather(*(store.begin(WS, KEY, FP, 3.0) for _ in range(CONCURRENT)))
        assert outcomes.count(Owned()) == 1
        assert outcomes.count(InProgress()) == CONCURRENT - 1

    async def test_owning_and_releasing_many_keys_in_turn_holds_nothing_back(
        self, store: IdempotencyStore
    ) -> None:
        """Every way out of ownership gives back what `begin` took (on PostgreSQL a pooled
        connection: a leak would exhaust the test pool long before the end)."""

        async def run() -> None:
            for i in range(30):
                owned = await store.begin(WS, f"key-{i}", FP, 1.0)
                assert isinstance(owned, Owned)
                if i % 3 == 0:
                    await store.finish(WS, f"key-{i}", FP, StoredResponse(202, {"i": i}), 2.0)
                elif i % 3 == 1:
                    assert await store.abandon(WS, f"key-{i}", 2.0)
                else:  # the route's `finally` may run before an abandon of a failed effect
                    await owned.release()
                    assert await store.abandon(WS, f"key-{i}", 2.0)
                await owned.release()

        await asyncio.wait_for(run(), timeout=30)
