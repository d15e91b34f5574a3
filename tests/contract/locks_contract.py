"""The compute-lock contract (docs/stages.md), written once and run against every backend.

A backend's test class subclasses `LocksContract` and overrides three fixtures: `store`;
`new_store`, a callable that builds another store of the backend on the same database from
constructor keywords (`sweep_limit=`, `new_token=`), closed at teardown; and `count_rows`, which
reads how many lock rows the database holds.
Time is passed explicitly, so expiry is tested without waiting on any clock.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from cv_server.locks import Acquired, ComputeLockStore, Locked

WS = "ws-1"
JOB = "job-1"
TASK = "eval:salary"
TTL = 60.0
CONCURRENT_ACQUIRERS = 50

#: `new_store(**constructor_keywords)`: another store of the backend on the test's database.
NewStore = Callable[..., ComputeLockStore]
#: `await count_rows()`: the lock rows in the database, live or dead.
CountRows = Callable[[], Awaitable[int]]


class LocksContract:
    """Every `ComputeLockStore` keeps these rules."""

    @pytest.fixture
    async def store(self) -> AsyncIterator[ComputeLockStore]:
        raise NotImplementedError("a backend's test class provides the store")
        yield  # noqa: PT022 - an async generator, like the overrides

    @pytest.fixture
    async def new_store(self) -> AsyncIterator[NewStore]:
        raise NotImplementedError("a backend's test class provides new_store")
        yield  # noqa: PT022 - an async generator, like the overrides

    @pytest.fixture
    def count_rows(self) -> CountRows:
        raise NotImplementedError("a backend's test class says how to count lock rows")

    async def acquired(
        self,
        store: ComputeLockStore,
        holder: str,
        now: float,
        *,
        ws: str = WS,
        job: str = JOB,
        task: str = TASK,
        ttl: float = TTL,
    ) -> Acquired:
        outcome = await store.acquire(ws, job, task, holder, ttl, now)
        assert isinstance(outcome, Acquired), outcome
        return outcome

    # -- mutual exclusion -------------------------------------------------------------------------

    async def test_exactly_one_of_many_concurrent_acquirers_gets_the_lock(
        self, store: ComputeLockStore
    ) -> None:
        outcomes = await asyncio.gather(
            *(
                store.acquire(WS, JOB, TASK, f"worker-{i}", TTL, 100.0)
                for i in range(CONCURRENT_ACQUIRERS)
            )
        )
        winners = [o for o in outcomes if isinstance(o, Acquired)]
        losers = [o for o in outcomes if isinstance(o, Locked)]
        assert len(winners) == 1
        assert len(losers) == CONCURRENT_ACQUIRERS - 1
        lock = await store.get(WS, JOB, TASK, 100.0)
        assert lock is not None
        assert lock.token == winners[0].token
        assert {o.holder for o in losers} == {lock.holder}
        assert {o.expires_at for o in losers} == {winners[0].expires_at}

    async def test_exactly_one_of_many_concurrent_acquirers_takes_over_an_expired_lock(
        self, store: ComputeLockStore
    ) -> None:
        await self.acquired(store, "crashed", 0.0, ttl=10.0)
        outcomes = await asyncio.gather(
            *(
                store.acquire(WS, JOB, TASK, f"worker-{i}", TTL, 10.0)
                for i in range(CONCURRENT_ACQUIRERS)
            )
        )
        winners = [o for o in outcomes if isinstance(o, Acquired)]
        assert len(winners) == 1
        lock = await store.get(WS, JOB, TASK, 10.0)
        assert lock is not None
        assert lock.token == winners[0].token
        assert lock.holder != "crashed"

    async def test_a_live_lock_is_refused_with_its_holder_and_expiry(
        self, store: ComputeLockStore
    ) -> None:
        first = await self.acquired(store, "alice", 0.0)
        assert first.expires_at == pytest.approx(TTL)
        outcome = await store.acquire(WS, JOB, TASK, "bob", TTL, TTL - 0.001)
        assert outcome == Locked(holder="alice", expires_at=first.expires_at)

    async def test_a_lock_is_dead_at_its_expiry_time(self, store: ComputeLockStore) -> None:
        first = await self.acquired(store, "alice", 0.0)
        assert await store.get(WS, JOB, TASK, first.expires_at) is None
        second = await self.acquired(store, "bob", first.expires_at)
        assert second.token != first.token

    # -- expiry and release -----------------------------------------------------------------------

    async def test_an_expired_lock_is_taken_over_and_the_old_holder_cannot_release_it(
        self, store: ComputeLockStore
    ) -> None:
        old = await self.acquired(store, "crashed", 0.0, ttl=10.0)
        new = await self.acquired(store, "bob", 10.5)
        assert await store.release(WS, JOB, TASK, old.token, 11.0) is False
        lock = await store.get(WS, JOB, TASK, 11.0)
        assert lock is not None
        assert (lock.holder, lock.token) == ("bob", new.token)
        assert await store.acquire(WS, JOB, TASK, "carol", TTL, 11.0) == Locked(
            holder="bob", expires_at=new.expires_at
        )

    async def test_release_by_a_non_holder_is_refused(self, store: ComputeLockStore) -> None:
        held = await self.acquired(store, "alice", 0.0)
        assert await store.release(WS, JOB, TASK, "not-the-token", 1.0) is False
        assert await store.release(WS, JOB, "another-task", held.token, 1.0) is False
        assert await store.release("ws-2", JOB, TASK, held.token, 1.0) is False
        lock = await store.get(WS, JOB, TASK, 1.0)
        assert lock is not None
        assert lock.token == held.token
        assert isinstance(await store.acquire(WS, JOB, TASK, "bob", TTL, 1.0), Locked)

    async def test_after_release_the_key_is_free(self, store: ComputeLockStore) -> None:
        held = await self.acquired(store, "alice", 0.0)
        assert await store.release(WS, JOB, TASK, held.token, 1.0) is True
        assert await store.get(WS, JOB, TASK, 1.0) is None
        again = await self.acquired(store, "bob", 1.0)
        assert again.token != held.token
        # The first holder's token died with its release: it cannot free bob's lock.
        assert await store.release(WS, JOB, TASK, held.token, 2.0) is False
        assert await store.get(WS, JOB, TASK, 2.0) is not None

    async def test_a_holder_may_release_its_own_expired_lock_that_nobody_took_over(
        self, store: ComputeLockStore
    ) -> None:
        held = await self.acquired(store, "slow", 0.0, ttl=1.0)
        assert await store.release(WS, JOB, TASK, held.token, 5.0) is True
        await self.acquired(store, "bob", 5.0)

    async def test_get_reports_the_live_lock(self, store: ComputeLockStore) -> None:
        assert await store.get(WS, JOB, TASK, 0.0) is None
        held = await self.acquired(store, "alice", 3.0, ttl=7.0)
        lock = await store.get(WS, JOB, TASK, 4.0)
        assert lock is not None
        assert (lock.workspace_id, lock.job_id, lock.task) == (WS, JOB, TASK)
        assert (lock.holder, lock.token) == ("alice", held.token)
        assert lock.acquired_at == pytest.approx(3.0)
        assert lock.expires_at == pytest.approx(10.0) == held.expires_at

    @pytest.mark.parametrize("ttl", [0.0, -1.0, math.inf, math.nan])
    async def test_a_ttl_that_is_not_positive_and_finite_is_refused(
        self, store: ComputeLockStore, ttl: float
    ) -> None:
        with pytest.raises(ValueError, match="ttl"):
            await store.acquire(WS, JOB, TASK, "alice", ttl, 0.0)
        assert await store.get(WS, JOB, TASK, 0.0) is None

    # -- key scope --------------------------------------------------------------------------------

    async def test_different_workspaces_with_the_same_job_and_task_do_not_contend(
        self, store: ComputeLockStore
    ) -> None:
        # The lock is workspace-internal; it never coordinates across workspaces.
        a = await self.acquired(store, "alice", 0.0, ws="ws-a")
        b = await self.acquired(store, "bob", 0.0, ws="ws-b")
        assert a.token != b.token
        assert await store.release("ws-b", JOB, TASK, a.token, 1.0) is False
        assert await store.release("ws-a", JOB, TASK, a.token, 1.0) is True
        lock = await store.get("ws-b", JOB, TASK, 1.0)
        assert lock is not None
        assert lock.holder == "bob"

    async def test_different_tasks_and_jobs_do_not_contend(self, store: ComputeLockStore) -> None:
        keys = [(JOB, "eval:salary"), (JOB, "eval:remote"), ("job-2", "eval:salary")]
        outcomes = await asyncio.gather(
            *(store.acquire(WS, job, task, f"w-{job}-{task}", TTL, 0.0) for job, task in keys)
        )
        assert all(isinstance(o, Acquired) for o in outcomes)
        for job, task in keys:
            lock = await store.get(WS, job, task, 0.0)
            assert lock is not None
            assert lock.holder == f"w-{job}-{task}"

    # -- cleaning ---------------------------------------------------------------------------------

    async def test_an_acquisition_deletes_expired_rows_of_other_keys(
        self, store: ComputeLockStore
    ) -> None:
        dead = [f"dead-{i}" for i in range(5)]
        for task in dead:
            await self.acquired(store, "crashed", 0.0, task=task, ttl=1.0)
        live = await self.acquired(store, "alive", 0.0, task="live", ttl=100.0)
        await self.acquired(store, "bob", 5.0, task="unrelated")
        # Asked at a time when they were alive: only deleted rows read as absent.
        for task in dead:
            assert await store.get(WS, JOB, task, 0.0) is None
        lock = await store.get(WS, JOB, "live", 0.0)
        assert lock is not None
        assert lock.token == live.token

    async def test_a_release_deletes_expired_rows_of_other_keys(
        self, store: ComputeLockStore
    ) -> None:
        await self.acquired(store, "crashed", 0.0, task="dead", ttl=1.0)
        held = await self.acquired(store, "alice", 0.0, task="mine", ttl=100.0)
        assert await store.release(WS, JOB, "mine", held.token, 5.0) is True
        assert await store.get(WS, JOB, "dead", 0.0) is None

    # -- the background sweep (`sweep`, cv_server/reaper.py) --------------------------------------

    async def test_sweep_deletes_dead_locks_in_bounded_batches_and_never_a_live_one(
        self, new_store: NewStore, count_rows: CountRows
    ) -> None:
        store = new_store(sweep_limit=0)  # no sweeping on acquisition: only `sweep` deletes
        for i in range(5):
            await self.acquired(store, "crashed", 0.0, task=f"dead-{i}", ttl=1.0)
        live = await self.acquired(store, "alive", 0.0, task="live", ttl=100.0)
        assert await store.sweep(1.0, limit=2) == 2  # dead at its expiry time, at most `limit`
        assert await count_rows() == 4
        assert await store.sweep(50.0, limit=10) == 3  # a short batch: caught up
        assert await store.sweep(50.0, limit=10) == 0
        lock = await store.get(WS, JOB, "live", 50.0)
        assert lock is not None
        assert lock.token == live.token
        assert await store.release(WS, JOB, "live", live.token, 50.0) is True

    async def test_concurrent_sweeps_delete_each_dead_lock_once(
        self, new_store: NewStore, count_rows: CountRows
    ) -> None:
        store = new_store(sweep_limit=0)
        for i in range(30):
            await self.acquired(store, "crashed", 0.0, task=f"dead-{i}", ttl=1.0)
        swept = await asyncio.gather(*(new_store().sweep(5.0, limit=7) for _ in range(6)))
        assert sum(swept) == 30 - await count_rows()
        while await store.sweep(5.0, limit=7):
            pass
        assert await count_rows() == 0

    async def test_a_sweep_limit_below_one_is_refused(self, store: ComputeLockStore) -> None:
        with pytest.raises(ValueError, match="limit"):
            await store.sweep(1.0, limit=0)

    # -- sweeping and construction ----------------------------------------------------------------

    async def test_the_sweep_of_other_keys_is_bounded_per_acquisition(
        self, new_store: NewStore, count_rows: CountRows
    ) -> None:
        store = new_store(sweep_limit=3)
        for i in range(10):
            outcome = await store.acquire("ws", "job", f"dead-{i}", "w", 1.0, 0.0)
            assert isinstance(outcome, Acquired)
        assert await count_rows() == 10
        assert isinstance(await store.acquire("ws", "job", "new", "w", 60.0, 5.0), Acquired)
        assert await count_rows() == 10 - 3 + 1
        # Each later acquisition sweeps another batch, so dead rows do not accumulate.
        for i in range(3):
            await store.acquire("ws", "job", f"new-{i}", "w", 60.0, 5.0)
        assert await count_rows() == 1 + 3

    async def test_a_dead_lock_is_taken_over_in_place_even_when_sweeping_is_off(
        self, new_store: NewStore, count_rows: CountRows
    ) -> None:
        store = new_store(sweep_limit=0)
        await store.acquire("ws", "job", "other", "w", 1.0, 0.0)
        old = await store.acquire("ws", "job", "task", "crashed", 1.0, 0.0)
        # Exactly at its expiry time the old lock is dead (expires_at <= now).
        new = await store.acquire("ws", "job", "task", "bob", 60.0, 1.0)
        assert isinstance(old, Acquired)
        assert isinstance(new, Acquired)
        assert new.token != old.token
        assert await count_rows() == 2

    async def test_tokens_come_from_the_injected_minter(self, new_store: NewStore) -> None:
        tokens = iter(["t-1", "t-2"])
        store = new_store(new_token=lambda: next(tokens))
        first = await store.acquire("ws", "job", "a", "w", 60.0, 0.0)
        second = await store.acquire("ws", "job", "b", "w", 60.0, 0.0)
        assert first == Acquired(token="t-1", expires_at=60.0)
        assert second == Acquired(token="t-2", expires_at=60.0)

    def test_a_negative_sweep_limit_is_refused(self, new_store: NewStore) -> None:
        with pytest.raises(ValueError, match="sweep_limit"):
            new_store(sweep_limit=-1)
