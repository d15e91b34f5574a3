"""The scheduler (docs/queue.md, "Schedules"): fires due schedules by enqueueing, under a
heartbeated lease in the database so that, of N server instances, one fires.

- **One firing, one request.** A firing's request id is deterministic in (schedule, due time)
  (`model.firing_request_id`): two instances that both believe they hold the lease (one paused
  past its lease, say) enqueue the same id, the queue coalesces the second, and `advance`'s
  compare-and-set lets one of them move the schedule on (tests/contract/schedules_contract.py).
- **The lease.** The holder renews it every `heartbeat` seconds, the lease lasting `lease`
  seconds (at least 3x the heartbeat, `ServerConfig`); the others try again when it would lapse,
  so a dead holder is replaced within one lease of its last renewal.
- **Wake-ups.** The holder sleeps until the next due time, its next renewal, or (with several
  instances) a re-read of the schedules every `recheck` seconds, for a schedule added through
  another instance, whichever comes first; `wake()` cuts a sleep short (a schedule added or
  resumed here). An embedded server, the only process serving its file, needs no re-read: an
  idle one wakes once a heartbeat. An idle scheduler logs nothing.

`fire_schedule` is the unit of work (backend-neutral, `now` a parameter); `Scheduler` is the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from cv_server.queue.model import LIVE_STATUSES, EnqueueAsk, Enqueued
from cv_server.queue.store import QueueStore
from cv_server.schedules.model import Schedule, firing_request, plan_firings
from cv_server.schedules.store import ScheduleStore

__all__ = ["LEASE_NAME", "Fired", "Scheduler", "fire_schedule"]

log = logging.getLogger(__name__)

#: The one scheduler lease of a deployment.
LEASE_NAME: Final = "scheduler"
#: Due schedules read per round: a bound on one read, not on the work (rounds repeat at once
#: while a full page comes back).
_DUE_PAGE: Final = 100


@dataclass(frozen=True, slots=True)
class Fired:
    """What one `fire_schedule` did: the requests it enqueued (`coalesced` ones another
    firing had already enqueued), how many due times it skipped for an overlap and for the
    missed-run policy, and whether it moved the schedule on (False: another scheduler did)."""

    schedule: Schedule
    slots: tuple[float, ...]
    enqueued: tuple[Enqueued, ...]
    overlap_skipped: int
    missed_skipped: int
    advanced: bool


async def fire_schedule(
    schedules: ScheduleStore,
    queue: QueueStore,
    schedule: Schedule,
    now: float,
    *,
    firing_since: float,
    catch_up_limit: int,
    max_dequeues: int,
) -> Fired | None:
    """Fire `schedule` if it is due at `now`: enqueue a request per due time the missed-run
    and overlap policies keep (one transaction), then move the schedule on. None if not due.

    Safe to run twice for the same due times, concurrently or not: the second enqueue
    coalesces into the first's requests and its `advance` is refused."""
    plan = plan_firings(schedule, now, firing_since=firing_since, catch_up_limit=catch_up_limit)
    if plan is None or schedule.next_fire_at is None:
        return None
    slots = plan.fire
    overlap_skipped = 0
    if schedule.spec.overlap == "skip" and slots:
        # Never pile up: with the last firing's request still live, nothing is enqueued; else
        # the latest due time only, since each would overlap the one before it.
        live = False
        if schedule.last_request_id is not None:
            row = await queue.get(schedule.workspace_id, schedule.last_request_id)
            live = row is not None and row.status in LIVE_STATUSES
        kept = () if live else slots[-1:]
        overlap_skipped = len(slots) - len(kept)
        slots = kept
    requests = [firing_request(schedule, slot, max_dequeues=max_dequeues) for slot in slots]
    enqueued = await queue.enqueue_many([EnqueueAsk(req) for req in requests], now=None)
    fired = (slots[-1], requests[-1].request_id) if slots else None
    advanced = await schedules.advance(
        schedule.workspace_id,
        schedule.schedule_id,
        expected=schedule.next_fire_at,
        next_fire_at=plan.next_fire_at,
        fired=fired,
        skipped=plan.missed + overlap_skipped,
    )
    return Fired(schedule, slots, tuple(enqueued), overlap_skipped, plan.missed, advanced)


class Scheduler:
    """The loop that holds (or waits for) the scheduler lease and fires due schedules.

    Start it with `start()` once the stores are open; `close()` stops it and gives the lease up,
    so another instance takes over at once. `on_fired(fired, now)` is told of each firing this
    instance did (metrics, logs); it must be quick and must not raise.
    """

    def __init__(
        self,
        schedules: ScheduleStore,
        queue: QueueStore,
        *,
        owner: str,
        lease_seconds: float,
        heartbeat_seconds: float,
        recheck_seconds: float,
        catch_up_limit: int,
        max_dequeues: int,
        on_fired: Callable[[Fired, float], None] = lambda fired, now: None,
        sole_instance: bool = False,
    ) -> None:
        """`sole_instance`: no other process can hold the lease (embedded SQLite, one server
        per file): a lease left by this process's predecessor, dead since, is taken at once."""
        if lease_seconds < 3 * heartbeat_seconds:
            raise ValueError("the scheduler lease must last at least 3x its heartbeat")
        self._schedules = schedules
        self._queue = queue
        self._owner = owner
        self._lease = lease_seconds
        self._heartbeat = heartbeat_seconds
        self._recheck = recheck_seconds
        self._catch_up_limit = catch_up_limit
        self._max_dequeues = max_dequeues
        self._on_fired = on_fired
        self._sole = sole_instance
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._holding = False
        #: Schedules whose last firing failed (logged once until one succeeds).
        self._failing: set[str] = set()

    @property
    def holding(self) -> bool:
        """Whether this instance held the lease at its last renewal."""
        return self._holding

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="scheduler")

    def wake(self) -> None:
        """Re-read the schedules now (one was added, resumed or run here)."""
        self._wake.set()

    async def close(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        if self._holding:
            self._holding = False
            with contextlib.suppress(Exception):
                await self._schedules.release_lease(LEASE_NAME, self._owner)

    async def _run(self) -> None:
        if self._sole:
            with contextlib.suppress(Exception):
                await self._schedules.release_lease(LEASE_NAME, self._owner)
        failing = False
        while True:
            try:
                wait = await self._round()
                if failing:
                    log.info("scheduler: storage answers again")
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception:
                if not failing:
                    log.exception("scheduler: a round failed; retrying every heartbeat")
                failing = True
                wait = self._heartbeat
            await self._sleep(wait)

    async def _round(self) -> float:
        """Renew (or try for) the lease and, holding it, fire what is due until the next
        renewal; return how long to sleep before the next round."""
        now = await self._schedules.clock()
        lease = await self._schedules.hold_lease(LEASE_NAME, self._owner, self._lease, now)
        was_holding, self._holding = self._holding, lease.held_by(self._owner)
        if not self._holding:
            if was_holding:
                log.warning("scheduler: lease lost to %s", lease.owner)
            # Try again when it would lapse, or at the next heartbeat if released before.
            return max(0.0, min(lease.expires_at - now, self._heartbeat))
        if not was_holding:
            log.info("scheduler: lease taken", extra={"owner": self._owner})
        renew_at = time.monotonic() + self._heartbeat
        while True:
            now = await self._schedules.clock()
            stuck = await self._fire_due(now, lease.held_since)
            next_due = await self._schedules.next_due_at()
            left = renew_at - time.monotonic()
            if left <= 0:
                return 0.0
            # A sole instance hears of every change to its schedules (`wake`): it re-reads
            # only when one falls due. Several instances re-read every `recheck` seconds, for a
            # schedule added through another. A schedule that could not fire stays due: it is
            # tried again at the next re-read, not at once (no busy loop), and the others still
            # fire on time meanwhile.
            wait = min(left, self._recheck) if stuck or not self._sole else left
            if next_due is not None and not stuck:
                wait = min(wait, max(0.0, next_due - now))
            if wait > 0:
                woken = await self._sleep(wait)
                if not woken and wait == left:
                    return 0.0

    async def _fire_due(self, now: float, firing_since: float) -> bool:
        """Fire every schedule due at `now`; True if one of them could not be fired (it is
        logged once until it fires again, and never stops the others)."""
        stuck = False
        after_failure: set[str] = set()
        while True:
            due = [
                s
                for s in await self._schedules.due(now, limit=_DUE_PAGE)
                if s.schedule_id not in after_failure
            ]
            for schedule in due:
                try:
                    fired = await fire_schedule(
                        self._schedules,
                        self._queue,
                        schedule,
                        now,
                        firing_since=firing_since,
                        catch_up_limit=self._catch_up_limit,
                        max_dequeues=self._max_dequeues,
                    )
                except asyncio.CancelledError:
                    raise
                except Exception:
                    stuck = True
                    after_failure.add(schedule.schedule_id)
                    if schedule.schedule_id not in self._failing:
                        self._failing.add(schedule.schedule_id)
                        log.exception(
                            "scheduler: schedule %s/%s could not fire; retrying",
                            schedule.workspace_id,
                            schedule.name,
                        )
                    continue
                self._failing.discard(schedule.schedule_id)
                if fired is not None:
                    try:
                        self._on_fired(fired, now)
                    except Exception:
                        log.exception("scheduler: on_fired failed")
            if len(due) < _DUE_PAGE:
                return stuck

    async def _sleep(self, seconds: float) -> bool:
        """Sleep `seconds` or until `wake()`; True if woken."""
        if not math.isfinite(seconds):
            seconds = self._heartbeat
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)
        except TimeoutError:
            return False
        finally:
            self._wake.clear()
        return True
