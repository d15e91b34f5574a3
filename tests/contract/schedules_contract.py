"""The schedule contract (docs/queue.md, "Schedules"), written once and run against every
backend: the store's verbs, the scheduler lease, and a firing (`fire_schedule`) on the backend's
own queue, fired twice for the same due time.

A backend's test class subclasses `SchedulesContract` and provides `schedules` and `queue`, two
stores on one fresh database, and `peer_schedules`, a second `ScheduleStore` on the same database
as another instance would open it (on PostgreSQL: its own pool). Time is passed explicitly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from cv_server.queue import QueueStore
from cv_server.schedules.firing import fire_schedule
from cv_server.schedules.model import MissedPolicy, OverlapPolicy, ScheduleSpec, firing_request_id
from cv_server.schedules.store import ScheduleExists, ScheduleNotFound, ScheduleStore

WS = "ws-1"
T0 = 1_000_000.0
BODY = {"stage": "nightly", "input": {"n": 1}}


def every(
    seconds: int,
    name: str = "tick",
    *,
    missed: MissedPolicy = "one",
    overlap: OverlapPolicy = "skip",
) -> ScheduleSpec:
    return ScheduleSpec(
        workspace_id=WS,
        name=name,
        enqueue=BODY,
        interval_seconds=seconds,
        missed=missed,
        overlap=overlap,
    )


class SchedulesContract:
    """Every `ScheduleStore` keeps these rules."""

    @pytest.fixture
    async def schedules(self) -> AsyncIterator[ScheduleStore]:
        raise NotImplementedError("a backend's test class provides the schedule store")
        yield  # noqa: PT022 - an async generator, like the overrides

    @pytest.fixture
    async def peer_schedules(self) -> AsyncIterator[ScheduleStore]:
        raise NotImplementedError("a backend's test class provides a second schedule store")
        yield  # noqa: PT022 - an async generator, like the overrides

    @pytest.fixture
    async def queue(self) -> AsyncIterator[QueueStore]:
        raise NotImplementedError("a backend's test class provides the queue store")
        yield  # noqa: PT022 - an async generator, like the overrides

    # -- schedules --------------------------------------------------------------------------------

    async def test_an_added_schedule_is_due_at_its_first_time_after_now(
        self, schedules: ScheduleStore
    ) -> None:
        added = await schedules.add(every(10), "sch-1", T0 + 0.5)
        assert added.anchor == T0 + 1
        assert added.next_fire_at == T0 + 1
        got = await schedules.get(WS, "tick")
        assert got == added
        assert await schedules.get("other-ws", "tick") is None

    async def test_a_cron_schedule_is_due_at_its_next_match_in_utc(
        self, schedules: ScheduleStore
    ) -> None:
        spec = ScheduleSpec(workspace_id=WS, name="hourly", enqueue=BODY, cron="0 * * * *")
        added = await schedules.add(spec, "sch-1", 3600.0 * 10 + 5)
        assert added.next_fire_at == 3600.0 * 11

    async def test_a_name_is_unique_in_its_workspace_only(self, schedules: ScheduleStore) -> None:
        await schedules.add(every(10), "sch-1", T0)
        with pytest.raises(ScheduleExists):
            await schedules.add(every(5), "sch-2", T0)
        other = ScheduleSpec(workspace_id="ws-2", name="tick", enqueue=BODY, interval_seconds=5)
        await schedules.add(other, "sch-3", T0)
        assert (await schedules.get(WS, "tick") or pytest.fail("gone")).schedule_id == "sch-1"

    async def test_list_pages_by_name_within_the_workspace(self, schedules: ScheduleStore) -> None:
        for i, name in enumerate(["c", "a", "b"]):
            await schedules.add(every(10, name), f"sch-{i}", T0)
        await schedules.add(
            ScheduleSpec(workspace_id="ws-2", name="a0", enqueue=BODY, interval_seconds=5),
            "sch-x",
            T0,
        )
        first = await schedules.list(WS, limit=2)
        assert [s.name for s in first] == ["a", "b"]
        rest = await schedules.list(WS, after="b", limit=2)
        assert [s.name for s in rest] == ["c"]

    async def test_delete_removes_the_schedule_once(self, schedules: ScheduleStore) -> None:
        await schedules.add(every(10), "sch-1", T0)
        assert await schedules.delete(WS, "tick") is True
        assert await schedules.delete(WS, "tick") is False
        assert await schedules.get(WS, "tick") is None
        assert await schedules.due(T0 + 100, limit=10) == []

    async def test_a_paused_schedule_is_never_due_and_resumes_after_now(
        self, schedules: ScheduleStore
    ) -> None:
        await schedules.add(every(10), "sch-1", T0)
        paused = await schedules.set_paused(WS, "tick", True, T0 + 2)
        assert paused.spec.paused
        assert paused.next_fire_at is None
        assert await schedules.due(T0 + 1000, limit=10) == []
        assert await schedules.next_due_at() is None
        # The times it was paused are not caught up: due next after the resume.
        resumed = await schedules.set_paused(WS, "tick", False, T0 + 95)
        assert not resumed.spec.paused
        assert resumed.next_fire_at == T0 + 101
        again = await schedules.set_paused(WS, "tick", False, T0 + 200)
        assert again.next_fire_at == T0 + 101  # resuming a running schedule changes nothing
        with pytest.raises(ScheduleNotFound):
            await schedules.set_paused(WS, "nope", True, T0)

    async def test_due_lists_running_schedules_soonest_first(
        self, schedules: ScheduleStore
    ) -> None:
        await schedules.add(every(30, "slow"), "sch-1", T0)
        await schedules.add(every(10, "fast"), "sch-2", T0 + 5)
        assert await schedules.next_due_at() == T0 + 1
        due = await schedules.due(T0 + 6, limit=10)
        assert [s.name for s in due] == ["slow", "fast"]
        assert [s.name for s in await schedules.due(T0 + 6, limit=1)] == ["slow"]
        assert await schedules.due(T0, limit=10) == []

    async def test_advance_moves_a_schedule_on_only_from_the_time_read(
        self, schedules: ScheduleStore, peer_schedules: ScheduleStore
    ) -> None:
        added = await schedules.add(every(10), "sch-1", T0)
        assert added.next_fire_at is not None
        moves = await asyncio.gather(
            *(
                store.advance(
                    WS,
                    "sch-1",
                    expected=added.next_fire_at,
                    next_fire_at=added.next_fire_at + 10,
                    fired=(added.next_fire_at, "s_req"),
                    skipped=1,
                )
                for store in (schedules, peer_schedules, schedules, peer_schedules)
            )
        )
        assert sorted(moves) == [False, False, False, True]
        after = await schedules.get(WS, "tick") or pytest.fail("gone")
        assert after.next_fire_at == added.next_fire_at + 10
        assert (after.last_fired_at, after.last_request_id, after.skipped) == (
            added.next_fire_at,
            "s_req",
            1,
        )

    async def test_a_firing_out_of_turn_is_recorded_unless_a_later_one_was(
        self, schedules: ScheduleStore
    ) -> None:
        await schedules.add(every(10), "sch-1", T0)
        await schedules.record_firing(WS, "sch-1", T0 + 50, "s_late")
        await schedules.record_firing(WS, "sch-1", T0 + 40, "s_early")
        got = await schedules.get(WS, "tick") or pytest.fail("gone")
        assert (got.last_fired_at, got.last_request_id) == (T0 + 50, "s_late")

    # -- the lease --------------------------------------------------------------------------------

    async def test_the_lease_has_one_owner_until_it_lapses(
        self, schedules: ScheduleStore, peer_schedules: ScheduleStore
    ) -> None:
        leases = await asyncio.gather(
            *(
                (schedules, peer_schedules)[i % 2].hold_lease("scheduler", f"i{i}", 30.0, T0)
                for i in range(10)
            )
        )
        owners = {lease.owner for lease in leases}
        assert len(owners) == 1
        (owner,) = owners
        # Renewed by its owner, held since the first take.
        renewed = await schedules.hold_lease("scheduler", owner, 30.0, T0 + 10)
        assert (renewed.owner, renewed.expires_at, renewed.held_since) == (owner, T0 + 40, T0)
        # Another caller gets it only once it lapsed, held from then.
        refused = await peer_schedules.hold_lease("scheduler", "other", 30.0, T0 + 40)
        assert refused.owner == owner
        taken = await peer_schedules.hold_lease("scheduler", "other", 30.0, T0 + 40.5)
        assert (taken.owner, taken.held_since) == ("other", T0 + 40.5)
        # The old owner's renewal now finds it taken.
        assert (await schedules.hold_lease("scheduler", owner, 30.0, T0 + 41)).owner == "other"

    async def test_a_released_lease_is_taken_at_once(
        self, schedules: ScheduleStore, peer_schedules: ScheduleStore
    ) -> None:
        await schedules.hold_lease("scheduler", "a", 30.0, T0)
        assert await peer_schedules.release_lease("scheduler", "b") is False
        assert await schedules.release_lease("scheduler", "a") is True
        taken = await peer_schedules.hold_lease("scheduler", "b", 30.0, T0 + 1)
        assert taken.owner == "b"

    async def test_a_bad_lease_ttl_is_refused(self, schedules: ScheduleStore) -> None:
        with pytest.raises(ValueError, match="ttl"):
            await schedules.hold_lease("scheduler", "a", 0.0, T0)

    # -- firing -----------------------------------------------------------------------------------

    async def test_firing_the_same_due_time_twice_enqueues_one_request(
        self, schedules: ScheduleStore, peer_schedules: ScheduleStore, queue: QueueStore
    ) -> None:
        added = await schedules.add(every(10, overlap="queue"), "sch-1", T0)
        slot = added.next_fire_at
        assert slot is not None
        # Two instances that both believe they hold the lease read the same due schedule.
        firings = await asyncio.gather(
            *(
                fire_schedule(
                    store,
                    queue,
                    added,
                    slot + 1,
                    firing_since=T0,
                    catch_up_limit=100,
                    max_dequeues=5,
                )
                for store in (schedules, peer_schedules)
            )
        )
        fired = [f for f in firings if f is not None]
        assert len(fired) == 2
        request_id = firing_request_id(WS, "sch-1", slot)
        assert [f.enqueued[0].row.request_id for f in fired] == [request_id, request_id]
        assert sorted(f.enqueued[0].coalesced for f in fired) == [False, True]
        assert sorted(f.advanced for f in fired) == [False, True]
        rows = await queue.list(workspace_id=WS)
        assert [row.request_id for row in rows] == [request_id]
        assert rows[0].stage == "nightly"
        assert rows[0].input == {"n": 1}
        after = await schedules.get(WS, "tick") or pytest.fail("gone")
        assert after.next_fire_at == slot + 10
        assert after.last_request_id == request_id
        # A third firing from the stale read changes nothing more.
        late = await fire_schedule(
            schedules, queue, added, slot + 2, firing_since=T0, catch_up_limit=100, max_dequeues=5
        )
        assert late is not None
        assert not late.advanced
        assert late.enqueued[0].coalesced
        assert len(await queue.list(workspace_id=WS)) == 1

    async def test_overlap_skip_enqueues_nothing_while_the_last_request_is_live(
        self, schedules: ScheduleStore, queue: QueueStore
    ) -> None:
        added = await schedules.add(every(10), "sch-1", T0)
        assert added.next_fire_at is not None
        first = await fire_schedule(
            schedules,
            queue,
            added,
            added.next_fire_at,
            firing_since=T0,
            catch_up_limit=100,
            max_dequeues=5,
        )
        assert first is not None
        assert len(first.enqueued) == 1
        current = await schedules.get(WS, "tick") or pytest.fail("gone")
        assert current.next_fire_at is not None
        second = await fire_schedule(
            schedules,
            queue,
            current,
            current.next_fire_at,
            firing_since=T0,
            catch_up_limit=100,
            max_dequeues=5,
        )
        assert second is not None
        assert (second.enqueued, second.overlap_skipped, second.advanced) == ((), 1, True)
        after = await schedules.get(WS, "tick") or pytest.fail("gone")
        assert after.skipped == 1
        assert after.last_request_id == first.enqueued[0].row.request_id
        assert len(await queue.list(workspace_id=WS)) == 1

    async def test_missed_all_enqueues_each_missed_time_once_in_one_firing(
        self, schedules: ScheduleStore, queue: QueueStore
    ) -> None:
        added = await schedules.add(every(1, missed="all", overlap="queue"), "sch-1", T0)
        assert added.next_fire_at == T0 + 1
        # Down from T0 + 0.5 to T0 + 5.5: due times T0+1..T0+5 were missed.
        fired = await fire_schedule(
            schedules,
            queue,
            added,
            T0 + 5.5,
            firing_since=T0 + 5.5,
            catch_up_limit=100,
            max_dequeues=5,
        )
        assert fired is not None
        assert fired.slots == (T0 + 1, T0 + 2, T0 + 3, T0 + 4, T0 + 5)
        ids = {firing_request_id(WS, "sch-1", s) for s in fired.slots}
        assert {row.request_id for row in await queue.list(workspace_id=WS)} == ids
        after = await schedules.get(WS, "tick") or pytest.fail("gone")
        assert after.next_fire_at == T0 + 6
