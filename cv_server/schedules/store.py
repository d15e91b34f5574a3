"""The schedule storage seam (docs/queue.md, "Schedules"): domain verbs every backend
implements, and the scheduler lease. Every backend passes the same contract suite
(`tests/contract/schedules_contract.py`).

Time is a parameter (`now`, epoch seconds). Which clock `now` should come from is the store's to
say (`clock`): several instances on one PostgreSQL database judge the scheduler lease and the
due times on the database's clock, never each on its own.
"""

from __future__ import annotations

import abc
import builtins
import math
from dataclasses import dataclass

from cv_server.errors import CvServerError
from cv_server.schedules.model import Schedule, ScheduleSpec

__all__ = [
    "Lease",
    "ScheduleError",
    "ScheduleExists",
    "ScheduleNotFound",
    "ScheduleStore",
    "check_lease_ttl",
]


class ScheduleError(CvServerError):
    """A refused schedule verb; `code` is its problem code."""

    code = "schedule_error"


class ScheduleExists(ScheduleError):
    """A schedule of that name already exists in the workspace."""

    code = "schedule_exists"


class ScheduleNotFound(ScheduleError):
    """No schedule of that name in the workspace."""

    code = "schedule_not_found"


@dataclass(frozen=True, slots=True)
class Lease:
    """The scheduler lease as it stands after a `hold_lease`: `owner` holds it until
    `expires_at`, and has since `held_since` (the start of its unbroken hold)."""

    owner: str
    expires_at: float
    held_since: float

    def held_by(self, owner: str) -> bool:
        return self.owner == owner


def check_lease_ttl(ttl: float) -> None:
    if not (math.isfinite(ttl) and ttl > 0):
        raise ValueError(f"lease ttl must be a positive finite number of seconds: {ttl!r}")


class ScheduleStore(abc.ABC):
    """The schedules of every workspace, and the lease that elects the one scheduler.

    Rules every implementation keeps (docs/queue.md, "Schedules"):
    - a schedule's name is unique in its workspace;
    - `advance` moves a schedule on only from the `next_fire_at` its caller read: of two
      schedulers that fired the same due time, one advances, the other is told it did not;
    - `hold_lease` gives the lease to one owner at a time: a caller gets it if it is free,
      lapsed (`expires_at < now`) or already its own (then it is renewed, `held_since` kept).
    """

    @abc.abstractmethod
    async def clock(self) -> float:
        """The time now on the clock every user of this store shares (PostgreSQL: the
        database's; embedded SQLite: this process's)."""

    # -- schedules --------------------------------------------------------------------------------

    @abc.abstractmethod
    async def add(self, spec: ScheduleSpec, schedule_id: str, now: float) -> Schedule:
        """Store a new schedule (checked by the caller: `model.check_spec`), due first at its
        first due time after `now` (none while paused). Raises `ScheduleExists`."""

    @abc.abstractmethod
    async def get(self, workspace_id: str, name: str) -> Schedule | None:
        """The schedule, or None."""

    @abc.abstractmethod
    async def list(
        self, workspace_id: str, *, after: str | None = None, limit: int = 100
    ) -> builtins.list[Schedule]:
        """At most `limit` schedules of the workspace by name, those after `after`."""

    @abc.abstractmethod
    async def delete(self, workspace_id: str, name: str) -> bool:
        """Delete the schedule; False if there was none. Requests it enqueued stay queued."""

    @abc.abstractmethod
    async def set_paused(self, workspace_id: str, name: str, paused: bool, now: float) -> Schedule:
        """Pause (no further firing; `next_fire_at` None) or resume (due next at its first due
        time after `now`: the times it was paused are never caught up). Pausing a paused or
        resuming a running schedule changes nothing. Raises `ScheduleNotFound`."""

    @abc.abstractmethod
    async def due(self, now: float, *, limit: int) -> builtins.list[Schedule]:
        """At most `limit` running schedules of every workspace with `next_fire_at <= now`,
        soonest first."""

    @abc.abstractmethod
    async def next_due_at(self) -> float | None:
        """The earliest `next_fire_at` of any running schedule, or None if none runs."""

    @abc.abstractmethod
    async def advance(
        self,
        workspace_id: str,
        schedule_id: str,
        *,
        expected: float,
        next_fire_at: float,
        fired: tuple[float, str] | None,
        skipped: int,
    ) -> bool:
        """Record a firing: if the schedule's `next_fire_at` is still `expected` (and it is not
        paused), set it to `next_fire_at`, add `skipped` to its skip count and, with `fired`
        (due time, request id), record it as its last firing; True if it did. False: another
        scheduler fired it first, or it was paused, resumed or deleted meanwhile."""

    @abc.abstractmethod
    async def record_firing(
        self, workspace_id: str, schedule_id: str, slot: float, request_id: str
    ) -> None:
        """Record a firing out of turn (run-now) as the last one, unless a later due time has
        already been recorded. A deleted schedule is left deleted."""

    # -- the scheduler lease ----------------------------------------------------------------------

    @abc.abstractmethod
    async def hold_lease(self, name: str, owner: str, ttl: float, now: float) -> Lease:
        """Take or renew lease `name` for `owner` until `now + ttl` if it is free, lapsed or
        `owner`'s; return the lease as it stands (someone else's if `owner` did not get it).
        Raises `ValueError` for a bad ttl."""

    @abc.abstractmethod
    async def release_lease(self, name: str, owner: str) -> bool:
        """Give lease `name` up if `owner` holds it (a clean stop: another instance takes over
        at once, not a lease later); True if it did."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the store's own resources (a shared database is closed by its owner)."""
