"""The worker's pure-ish parts: the TTL cache, single-flight, the request key both use, and the
per-run telemetry meter (docs/queue.md). No HTTP here; the clock and the probes are parameters.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import sys
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

from cv_workspace_client.errors import LeaseLostError
from cv_workspace_client.stage import StageRequest

__all__ = ["RunMeter", "SingleFlight", "TtlCache", "request_key", "rss_bytes"]

logger = logging.getLogger("cv_workspace_client.worker")

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

_MISS: Final = object()


def request_key(request: StageRequest) -> str | None:
    """The identity of "this stage on this input" for the TTL cache and single-flight: workspace,
    stage, job, branch, the enqueuer's grant and the canonical JSON of the input (sorted keys, no
    spaces).

    The workspace and the grant are part of it (the cache-safety rule: two scopes never share
    an answer, tests/worker/test_enqueue_grant.py),
    and so are the job and branch, which the handler sees. None when the input has no canonical
    JSON form (NaN, non-JSON types): such a request is never cached nor shared.
    """
    try:
        return json.dumps(
            [
                request.workspace_id,
                request.stage,
                request.job_id,
                request.branch_path,
                request.input,
                *([] if request.scope_key is None else [request.scope_key]),
            ],
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
            allow_nan=False,
        )
    except (TypeError, ValueError):
        return None


class TtlCache(Generic[K]):
    """Results by key, each fresh for its own TTL; at most `capacity` entries, the oldest evicted
    first (500 entries, oldest-first). `clock` is monotonic seconds (injectable)."""

    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._clock = clock
        self._entries: OrderedDict[K, tuple[float, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> tuple[bool, Any]:
        """`(True, value)` if a fresh entry exists, else `(False, None)` (an expired one is
        dropped)."""
        entry = self._entries.get(key, _MISS)
        if entry is _MISS:
            return False, None
        assert isinstance(entry, tuple)
        expires_at, value = entry
        if self._clock() >= expires_at:
            del self._entries[key]
            return False, None
        return True, value

    def put(self, key: K, value: Any, ttl: float) -> None:
        """Store `value` for `ttl` seconds. A re-stored key counts as the newest entry."""
        self._entries.pop(key, None)
        self._entries[key] = (self._clock() + ttl, value)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)


@dataclass(frozen=True, slots=True)
class _Shared:
    """What a leader hands its followers: its value, or the exception it raised."""

    value: Any = None
    error: BaseException | None = None


class SingleFlight(Generic[K]):
    """Identical concurrent executions share one run (docs/queue.md: one in-flight promise per key
    inside the worker — it covers the lease-lapse double-claim window).

    A follower gets the leader's value or exception. If the leader is cancelled or loses its lease
    (the worker's drain ran out, or another worker re-drove it), its followers run on their own.
    """

    def __init__(self) -> None:
        self._flights: dict[K, asyncio.Future[_Shared]] = {}

    def running(self, key: K) -> bool:
        return key in self._flights

    async def run(self, key: K, work: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """`(value, shared)`: `shared` is True when another caller's run produced it."""
        while (flight := self._flights.get(key)) is not None:
            # shield: a cancelled follower must not cancel the leader's run.
            shared = await asyncio.shield(flight)
            if isinstance(shared.error, asyncio.CancelledError | LeaseLostError):
                continue  # the leader gave up or lost its lease: lead ourselves (or follow anew)
            if shared.error is not None:
                raise shared.error
            return shared.value, True
        future: asyncio.Future[_Shared] = asyncio.get_running_loop().create_future()
        self._flights[key] = future
        try:
            value = await work()
        except BaseException as exc:
            future.set_result(_Shared(error=exc))
            raise
        else:
            future.set_result(_Shared(value=value))
            return value, False
        finally:
            if self._flights.get(key) is future:
                del self._flights[key]


class _Statm:
    """/proc/self/statm, opened once and re-read with pread (a stage finish is a hot path)."""

    fd: int | None = None
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """This process's resident set size now (Linux: /proc/self/statm); elsewhere the peak RSS,
    the closest portable figure."""
    try:
        if _Statm.fd is None:
            _Statm.fd = os.open("/proc/self/statm", os.O_RDONLY)
        return int(os.pread(_Statm.fd, 128, 0).split()[1]) * _Statm.page
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


@dataclass
class RunMeter:
    """Per-run telemetry (docs/queue.md): wall seconds, process CPU seconds during the run, RSS at
    the finish, and queue wait (claimed_at - created_at, both server times).

    Telemetry must never break the job path: any error while measuring yields None, and the
    completion goes out without it. The probes are parameters so tests can break them.
    """

    request: StageRequest
    wall: Callable[[], float] = time.perf_counter
    cpu: Callable[[], float] = time.process_time
    rss: Callable[[], int] = rss_bytes
    _started: tuple[float, float] | None = field(default=None, init=False)

    def start(self) -> RunMeter:
        try:
            self._started = (self.wall(), self.cpu())
        except Exception:
            logger.debug("telemetry probe failed at start", exc_info=True)
            self._started = None
        return self

    def finish(self, **extra: Any) -> dict[str, Any] | None:
        try:
            if self._started is None:
                return None
            wall0, cpu0 = self._started
            data: dict[str, Any] = {
                "wall_s": round(self.wall() - wall0, 6),
                "cpu_s": round(self.cpu() - cpu0, 6),
                "rss_bytes": int(self.rss()),
            }
            if self.request.claimed_at is not None:
                data["queue_wait_s"] = round(self.request.claimed_at - self.request.created_at, 6)
            data.update(extra)
            json.dumps(data, allow_nan=False)  # it goes on the wire: must be plain JSON
            return data
        except Exception:
            logger.debug("telemetry dropped", exc_info=True)
            return None
