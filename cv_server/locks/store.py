"""The compute-lock storage seam (layer 2, docs/stages.md): domain verbs every backend
implements. Every backend passes the same contract suite (`tests/contract/locks_contract.py`).

A compute lock dedupes one expensive call *inside* a stage run (an LLM call per column), keyed on
`(workspace_id, job_id, task)`. It is workspace-internal by construction: the workspace is part of
the key, so two workspaces never contend (the queue, not this lock, is the
cross-workspace coordinator).

Time is a parameter (`now`, epoch seconds) and so is the TTL: callers pass
`ServerConfig.compute_lock_ttl_seconds` (60 s, docs/configuration.md); the verbs read no clock.
Which clock `now` should come from is the store's to say (`clock`): with several server instances on
one PostgreSQL database, each instance's own wall clock would judge the same lock differently (one
running ahead takes live locks over, and sweeps them as dead), so there it is the database's.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "DEFAULT_SWEEP_LIMIT",
    "AcquireOutcome",
    "Acquired",
    "ComputeLockStore",
    "LockInfo",
    "Locked",
    "check_ttl",
]

#: Dead rows of *other* keys deleted per acquisition. A bound, not a tuning constant: it keeps an
#: acquisition's write job short however many dead rows piled up, while still removing them far
#: faster than one acquirer (one new row) can add them.
DEFAULT_SWEEP_LIMIT = 100


@dataclass(frozen=True, slots=True)
class Acquired:
    """The caller holds the lock until `expires_at`; `token` is what `release` must present."""

    token: str
    expires_at: float


@dataclass(frozen=True, slots=True)
class Locked:
    """Someone else holds a live lock on the key ("someone else is on it"): the caller
    should wait for the broadcast of that holder's write rather than compute."""

    holder: str | None
    expires_at: float


AcquireOutcome = Acquired | Locked


@dataclass(frozen=True, slots=True)
class LockInfo:
    """A live lock, for inspection (`get`)."""

    workspace_id: str
    job_id: str
    task: str
    holder: str
    token: str
    acquired_at: float
    expires_at: float


def check_ttl(ttl: float) -> None:
    """Reject a TTL that would create a lock already expired (or never expiring)."""
    if not (ttl > 0 and math.isfinite(ttl)):
        raise ValueError(f"compute lock ttl must be a positive finite number of seconds: {ttl!r}")


class ComputeLockStore(abc.ABC):
    """Compute locks of every workspace.

    Rules every implementation keeps (docs/stages.md, docs/concepts.md):
    - `acquire` is an atomic insert-or-ignore on `(workspace_id, job_id, task)`: of any number of
      concurrent acquirers of a free key, exactly one gets `Acquired`;
    - a lock with `expires_at <= now` is dead: the next acquisition of its key deletes it and takes
      the key, in the same transaction, so a crashed worker blocks a key for at most one TTL;
      the same transaction also deletes a bounded batch of other dead rows, so keys nobody asks
      for again do not accumulate;
    - every acquisition mints a fresh token; only that token releases the lock, so a holder that
      outran its TTL can never release the lock of whoever took the key over.
    """

    def __init__(self, *, sweep_limit: int, new_token: Callable[[], str]) -> None:
        """`sweep_limit`: dead rows of other keys each acquisition deletes at most; `new_token`
        mints each acquisition's token. Pinned on both backends by
        tests/contract/locks_contract.py."""
        if sweep_limit < 0:
            raise ValueError(f"sweep_limit must be >= 0: {sweep_limit!r}")
        self._sweep_limit = sweep_limit
        self._new_token = new_token

    async def clock(self) -> float:
        """The time now (epoch seconds) on the clock every user of this store shares: pass it as
        `now` when there is no clock to inject. The default, this process's wall clock, is right
        for a store only one process opens (embedded SQLite)."""
        return time.time()

    @abc.abstractmethod
    async def acquire(
        self, workspace_id: str, job_id: str, task: str, holder: str, ttl: float, now: float
    ) -> AcquireOutcome:
        """Take the lock for `ttl` seconds from `now`, or report who holds it.

        Call before the expensive call; on `Acquired`, double-check that the result is still
        missing, compute, then `release` with the token. On `Locked`, do not compute.
        Raises `ValueError` if `ttl` is not a positive finite number.
        """

    @abc.abstractmethod
    async def release(
        self, workspace_id: str, job_id: str, task: str, token: str, now: float
    ) -> bool:
        """Delete the lock if it carries `token`; True if it did.

        False means the caller no longer held the key (it expired and was taken over, or was
        already released): nothing is changed. A lock of ours that expired but that nobody took
        over is still deleted (True): no one else can have held the key in between, since taking
        it over replaces the token. `now` drives the same bounded sweep of dead rows as `acquire`.
        """

    @abc.abstractmethod
    async def get(self, workspace_id: str, job_id: str, task: str, now: float) -> LockInfo | None:
        """The live lock on the key at `now`, or None (a dead lock counts as free)."""

    async def list_live(
        self,
        workspace_id: str,
        now: float,
        *,
        after: tuple[str, str] | None = None,
        limit: int,
    ) -> list[LockInfo]:
        """The workspace's live locks at `now` (operators), by `(job_id, task)` in the backend's
        order of names (byte order on SQLite, the database's collation on PostgreSQL).

        At most `limit` of them, those whose key sorts after `after` (the `(job_id, task)` of the
        previous page's last lock; None: from the first). Dead locks are not listed, as `get`
        does not return them. Raises `ValueError` if `limit` is negative.
        """
        if limit < 0:
            raise ValueError(f"limit must be >= 0: {limit!r}")
        job_after, task_after = after if after is not None else ("", "")
        return await self._list_live(workspace_id, now, job_after, task_after, limit)

    @abc.abstractmethod
    async def _list_live(
        self, workspace_id: str, now: float, job_after: str, task_after: str, limit: int
    ) -> list[LockInfo]:
        """`list_live` once its arguments are checked: keys after `(job_after, task_after)`
        (`("", "")`: from the first), at most `limit` (>= 0)."""

    async def sweep(self, now: float, *, limit: int) -> int:
        """Delete at most `limit` dead locks (`expires_at <= now`) of any key, in one short
        transaction; return how many. The background pass (`cv_server.reaper`) calls it in a
        loop until a batch comes back short, so dead rows of keys nobody acquires again do
        not pile up between acquisitions. A live lock is never touched. Raises `ValueError`
        if `limit < 1`."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1: {limit!r}")
        return await self._sweep_dead(now, limit)

    @abc.abstractmethod
    async def _sweep_dead(self, now: float, limit: int) -> int:
        """`sweep` once its limit is checked."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the store's own resources (a shared database is closed by its owner)."""
