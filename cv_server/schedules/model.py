"""Schedules, the pure rules (docs/queue.md, "Schedules"): when a schedule falls due, which of
its due times a firing enqueues, and the id of the request each of them enqueues.

A schedule's only job is to enqueue: a firing adds one request to the queue, where retries,
poison and metrics already are. Everything here is a function of its arguments (`now` is a
parameter, epoch seconds UTC); the asyncio loop that calls it is `cv_server.schedules.firing`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Literal, get_args

from croniter import croniter

from cv_server.queue.model import NewRequest

__all__ = [
    "MISSED_POLICIES",
    "OVERLAP_POLICIES",
    "FiringPlan",
    "MissedPolicy",
    "OverlapPolicy",
    "Schedule",
    "ScheduleSpec",
    "anchor_for",
    "check_spec",
    "firing_request",
    "firing_request_id",
    "first_slot",
    "next_slot_after",
    "plan_firings",
]

#: What a firing does about due times that passed while no scheduler was running (the server
#: down, or no instance holding the scheduler lease): `skip` enqueues none of them, `one`
#: enqueues the latest one only, `all` enqueues each of them, oldest first, up to the catch-up
#: limit (`ServerConfig.schedule_catch_up_limit`), the most recent ones kept.
MissedPolicy = Literal["skip", "one", "all"]
MISSED_POLICIES: Final[tuple[MissedPolicy, ...]] = get_args(MissedPolicy)

#: What a firing does while the request of the schedule's previous firing is still live
#: (pending or in progress): `skip` enqueues nothing for that due time (counted in
#: `cv_schedule_skips_total`), `queue` enqueues it anyway, behind the live one.
OverlapPolicy = Literal["skip", "queue"]
OVERLAP_POLICIES: Final[tuple[OverlapPolicy, ...]] = get_args(OverlapPolicy)

#: Prefix and version of the firing id recipe; bump the version if the recipe ever changes.
_FIRING_RECIPE: Final = "cv-schedule/v1"
#: 40 hex chars of sha256, as the queue's own ids (`cv_server.queue.model`).
_ID_HEX_CHARS: Final = 40


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """What someone asks to schedule.

    Exactly one of `cron` (five UTC fields: minute hour day month weekday) and
    `interval_seconds` (whole seconds >= 1) is set. `enqueue` is the body of the enqueue route
    (`stage`, `job_id`, `branch_path`, `input`, `worker_class`, `max_dequeues`), already
    validated; `enqueue_grant` is the creator's grant (`cv_server.scopes.enqueue_grant`), under
    which every firing's request runs.
    """

    workspace_id: str
    name: str
    enqueue: Mapping[str, Any]
    cron: str | None = None
    interval_seconds: int | None = None
    missed: MissedPolicy = "one"
    overlap: OverlapPolicy = "skip"
    paused: bool = False
    enqueue_grant: Any = None


@dataclass(frozen=True, slots=True)
class Schedule:
    """One stored schedule: its spec, and where its firing stands.

    `anchor` is where an interval schedule's due times count from (`anchor + k * interval`).
    `next_fire_at` is its next due time (None while paused: resuming computes it afresh, so a
    pause never leaves due times to catch up). `last_fired_at` / `last_request_id` are the due
    time of its latest firing that enqueued and that request's id.
    """

    schedule_id: str
    spec: ScheduleSpec
    created_at: float
    anchor: float
    next_fire_at: float | None
    last_fired_at: float | None = None
    last_request_id: str | None = None
    #: Due times no request was enqueued for (overlap `skip`, missed `skip`/`one`/`all`'s bound).
    skipped: int = field(default=0)

    @property
    def workspace_id(self) -> str:
        return self.spec.workspace_id

    @property
    def name(self) -> str:
        return self.spec.name

    def to_json(self) -> dict[str, Any]:
        """The wire shape (the `Schedule` model of `cv_server.http.models`)."""
        spec = self.spec
        return {
            "schedule_id": self.schedule_id,
            "workspace_id": spec.workspace_id,
            "name": spec.name,
            "cron": spec.cron,
            "interval_seconds": spec.interval_seconds,
            "enqueue": dict(spec.enqueue),
            "missed": spec.missed,
            "overlap": spec.overlap,
            "paused": spec.paused,
            "enqueue_grant": spec.enqueue_grant,
            "created_at": self.created_at,
            "next_fire_at": self.next_fire_at,
            "last_fired_at": self.last_fired_at,
            "last_request_id": self.last_request_id,
            "skipped": self.skipped,
        }


def check_spec(spec: ScheduleSpec) -> None:
    """Raise `ValueError` (its message for the caller) unless `spec` can be fired."""
    if (spec.cron is None) == (spec.interval_seconds is None):
        raise ValueError("a schedule has exactly one of cron and interval_seconds")
    if spec.cron is not None:
        fields = spec.cron.split()
        # Five fields only: a sixth means seconds in some dialects and years in others.
        if len(fields) != 5 or not croniter.is_valid(spec.cron):
            raise ValueError(
                f"cron must be five UTC fields (minute hour day month weekday): {spec.cron!r}"
            )
    if spec.interval_seconds is not None and spec.interval_seconds < 1:
        raise ValueError(f"interval_seconds must be >= 1: {spec.interval_seconds!r}")
    if spec.missed not in MISSED_POLICIES:
        raise ValueError(f"missed must be one of {', '.join(MISSED_POLICIES)}")
    if spec.overlap not in OVERLAP_POLICIES:
        raise ValueError(f"overlap must be one of {', '.join(OVERLAP_POLICIES)}")
    if not isinstance(spec.enqueue.get("stage"), str):
        raise ValueError("the enqueue body must name its stage")


def next_slot_after(spec: ScheduleSpec, anchor: float, after: float) -> float:
    """The first due time of `spec` strictly after `after` (epoch seconds, UTC).

    Cron: the cron's next match, in UTC (no daylight-saving day runs twice or never).
    Interval: the next `anchor + k * interval_seconds`, k a whole number."""
    if spec.cron is not None:
        start = datetime.fromtimestamp(after, UTC)
        return float(croniter(spec.cron, start).get_next(float))
    assert spec.interval_seconds is not None
    step = spec.interval_seconds
    k = math.floor((after - anchor) / step) + 1
    slot = anchor + k * step
    # Float division may land one step short or long of the boundary.
    while slot <= after:
        slot += step
    while slot - step > after:
        slot -= step
    return slot


def anchor_for(now: float) -> float:
    """Where a schedule added at `now` counts its interval from: the next whole second, so an
    interval schedule's due times are whole seconds (and its firing ids stable to the ms)."""
    return float(math.floor(now) + 1)


def first_slot(spec: ScheduleSpec, anchor: float, now: float) -> float:
    """The first due time of a new or resumed schedule: the first after `now`, so adding or
    resuming one never catches up on times before it."""
    return next_slot_after(spec, anchor, now)


@dataclass(frozen=True, slots=True)
class FiringPlan:
    """What one firing of a due schedule does: enqueue a request for each of `fire` (due
    times, oldest first), count `missed` due times as skipped, and store `next_fire_at`."""

    fire: tuple[float, ...]
    missed: int
    next_fire_at: float


def plan_firings(
    schedule: Schedule, now: float, *, firing_since: float, catch_up_limit: int
) -> FiringPlan | None:
    """The firing of `schedule` at `now`, or None if it is not due (or paused).

    Due times are `next_fire_at` and every later one up to `now`. Those before `firing_since`
    (when this scheduler's lease began) were missed, no scheduler running then: the missed
    policy decides which of them are enqueued. Those at or after it are on time and all are
    enqueued (a loop that woke late still enqueues each). A firing never enqueues more than
    `catch_up_limit` due times: the latest ones are kept.
    """
    if schedule.spec.paused or schedule.next_fire_at is None or schedule.next_fire_at > now:
        return None
    if catch_up_limit < 1:
        raise ValueError(f"catch_up_limit must be >= 1: {catch_up_limit!r}")
    spec, anchor = schedule.spec, schedule.anchor
    missed: list[float] = []
    on_time: list[float] = []
    slot = schedule.next_fire_at
    count = 0
    while slot <= now:
        (missed if slot < firing_since else on_time).append(slot)
        count += 1
        # Only the latest `catch_up_limit` of each list can matter: drop older ones as we go,
        # so a schedule due every second after a month down costs a bounded list, not 2.6 M.
        if len(missed) > catch_up_limit:
            del missed[0]
        if len(on_time) > catch_up_limit:
            del on_time[0]
        slot = next_slot_after(spec, anchor, slot)
    if spec.missed == "skip":
        chosen_missed: list[float] = []
    elif spec.missed == "one":
        chosen_missed = missed[-1:]
    else:
        chosen_missed = missed
    fire = (chosen_missed + on_time)[-catch_up_limit:]
    return FiringPlan(fire=tuple(fire), missed=count - len(fire), next_fire_at=slot)


def firing_request_id(workspace_id: str, schedule_id: str, slot: float) -> str:
    """The id of the request a firing of `schedule_id` for due time `slot` enqueues.

    Deterministic in (workspace, schedule, due time): two instances that both fire the same due
    time enqueue the same id, and the queue coalesces the second into the first, so a due time
    yields one request whoever fires it, however often. The due time is taken to the
    millisecond. Recipe: `"s_" + sha256(canonical JSON of ["cv-schedule/v1", workspace_id,
    schedule_id, slot_ms])` truncated to 40 hex chars.
    """
    parts = [_FIRING_RECIPE, workspace_id, schedule_id, round(slot * 1000)]
    canonical = json.dumps(parts, separators=(",", ":"), ensure_ascii=False)
    return "s_" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:_ID_HEX_CHARS]


def firing_request(schedule: Schedule, slot: float, *, max_dequeues: int) -> NewRequest:
    """The request a firing of `schedule` for due time `slot` enqueues: the schedule's enqueue
    body, under the schedule creator's grant, with the firing's id. `max_dequeues` is the
    server's, used unless the body names its own."""
    body = schedule.spec.enqueue
    asked = body.get("max_dequeues")
    return NewRequest(
        workspace_id=schedule.workspace_id,
        stage=body["stage"],
        request_id=firing_request_id(schedule.workspace_id, schedule.schedule_id, slot),
        input=body.get("input"),
        job_id=body.get("job_id"),
        branch_path=body.get("branch_path"),
        worker_class=body.get("worker_class"),
        max_dequeues=max_dequeues if asked is None else int(asked),
        enqueue_grant=schedule.spec.enqueue_grant,
    )
