"""The pure rules of schedules: due times, the missed-run policy, the firing id."""

from __future__ import annotations

import dataclasses

import pytest

from cv_server.schedules.model import (
    Schedule,
    ScheduleSpec,
    check_spec,
    firing_request,
    firing_request_id,
    next_slot_after,
    plan_firings,
)

T0 = 1_000_000.0


def schedule(missed: str = "one", every: int = 1, next_fire_at: float = T0 + 1) -> Schedule:
    spec = ScheduleSpec(
        workspace_id="ws",
        name="tick",
        enqueue={"stage": "s", "max_dequeues": 2},
        interval_seconds=every,
        missed=missed,  # type: ignore[arg-type]
        enqueue_grant={"scopes": ["enqueue"], "sub_docs": None},
    )
    return Schedule("sch", spec, T0, T0, next_fire_at)


def test_an_interval_is_counted_from_its_anchor() -> None:
    spec = schedule(every=10).spec
    assert next_slot_after(spec, T0, T0) == T0 + 10
    assert next_slot_after(spec, T0, T0 + 9.99) == T0 + 10
    assert next_slot_after(spec, T0, T0 + 10) == T0 + 20


def test_a_cron_matches_in_utc() -> None:
    spec = ScheduleSpec("ws", "n", {"stage": "s"}, cron="30 2 * * *")
    # 2026-03-29 is Europe's spring-forward day: in UTC 02:30 happens, once.
    assert next_slot_after(spec, 0.0, 1774742400.0) == 1774742400.0 + 2.5 * 3600


@pytest.mark.parametrize(
    "spec",
    [
        ScheduleSpec("ws", "n", {"stage": "s"}),
        ScheduleSpec("ws", "n", {"stage": "s"}, cron="* * * * *", interval_seconds=5),
        ScheduleSpec("ws", "n", {"stage": "s"}, cron="* * * * * *"),
        ScheduleSpec("ws", "n", {"stage": "s"}, cron="61 * * * *"),
        ScheduleSpec("ws", "n", {"stage": "s"}, interval_seconds=0),
        ScheduleSpec("ws", "n", {"stage": "s"}, interval_seconds=1, missed="most"),  # type: ignore[arg-type]
        ScheduleSpec("ws", "n", {"stage": "s"}, interval_seconds=1, overlap="pile"),  # type: ignore[arg-type]
        ScheduleSpec("ws", "n", {}, interval_seconds=1),
    ],
)
def test_a_spec_that_cannot_fire_is_refused(spec: ScheduleSpec) -> None:
    with pytest.raises(ValueError, match=r"\w"):
        check_spec(spec)


def test_a_schedule_not_yet_due_plans_nothing() -> None:
    assert plan_firings(schedule(), T0 + 0.5, firing_since=T0, catch_up_limit=10) is None


def test_on_time_due_times_all_fire_whatever_the_missed_policy() -> None:
    for missed in ("skip", "one", "all"):
        plan = plan_firings(schedule(missed), T0 + 3.5, firing_since=T0, catch_up_limit=10)
        assert plan is not None
        assert (plan.fire, plan.missed, plan.next_fire_at) == ((T0 + 1, T0 + 2, T0 + 3), 0, T0 + 4)


@pytest.mark.parametrize(
    ("missed", "fire"),
    [
        ("skip", (T0 + 5,)),
        ("one", (T0 + 4, T0 + 5)),
        ("all", (T0 + 1, T0 + 2, T0 + 3, T0 + 4, T0 + 5)),
    ],
)
def test_the_missed_policy_decides_the_times_before_the_lease_began(
    missed: str, fire: tuple[float, ...]
) -> None:
    # Lease taken at T0 + 4.5: T0+1..T0+4 were missed, T0+5 is on time.
    plan = plan_firings(schedule(missed), T0 + 5.5, firing_since=T0 + 4.5, catch_up_limit=10)
    assert plan is not None
    assert plan.fire == fire
    assert plan.missed == 5 - len(fire)
    assert plan.next_fire_at == T0 + 6


def test_a_catch_up_keeps_the_latest_times_up_to_its_limit() -> None:
    plan = plan_firings(
        schedule("all"), T0 + 86_400.5, firing_since=T0 + 86_400.5, catch_up_limit=3
    )
    assert plan is not None
    assert plan.fire == (T0 + 86_398, T0 + 86_399, T0 + 86_400)
    assert plan.missed == 86_400 - 3
    assert plan.next_fire_at == T0 + 86_401


def test_a_paused_schedule_plans_nothing() -> None:
    s = schedule()
    paused = Schedule(s.schedule_id, dataclasses.replace(s.spec, paused=True), T0, T0, None)
    assert plan_firings(paused, T0 + 100, firing_since=T0, catch_up_limit=10) is None


def test_the_firing_id_is_deterministic_in_schedule_and_due_time() -> None:
    a = firing_request_id("ws", "sch", T0 + 1)
    assert a == firing_request_id("ws", "sch", T0 + 1.0000001)
    assert a.startswith("s_")
    assert len(a) == 42
    assert (
        len(
            {
                a,
                firing_request_id("ws", "sch", T0 + 2),
                firing_request_id("ws", "x", T0 + 1),
                firing_request_id("w2", "sch", T0 + 1),
            }
        )
        == 4
    )


def test_a_firing_request_runs_under_the_creators_grant() -> None:
    req = firing_request(schedule(), T0 + 1, max_dequeues=5)
    assert req.request_id == firing_request_id("ws", "sch", T0 + 1)
    assert req.enqueue_grant == {"scopes": ["enqueue"], "sub_docs": None}
    assert (req.stage, req.max_dequeues) == ("s", 2)
