"""What the peer sides of `bench.pg_queue` and `bench.latency` share. Standard library only: the
peers run it from their throwaway virtualenvs, where nothing of this project is installed.

Latency is enqueue → stage start: the enqueuer takes `time.time()` just before its enqueue call,
the job takes `time.time()` first thing when it runs and writes `index start` to a log file (after
taking the time, so the write is not measured). Two phases, one after the other, on a worker that
stays up: *idle* (one job at a time; the next is enqueued only after the previous one started and
a gap has passed, so the worker is idle-waiting each time: this measures its wake-up) and *load*
(jobs enqueued at a steady rate whatever the worker does, up to `LOAD_IN_FLIGHT` enqueue calls in
flight so that a slow call does not lower the rate). Before them, `WARMUP_JOBS` jobs are run
and waited for, unmeasured: the worker's start-up is not a latency.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

#: Give up on a phase when its last job has not started this long after its enqueue.
PHASE_TIMEOUT_S = 120.0
#: How often the driver looks whether a job has started (the measure is taken by the job).
POLL_S = 0.005
#: Jobs run (and waited for) before the idle phase, not measured: the worker is up and warm.
WARMUP_JOBS = 3
#: Load phase: enqueue calls in flight at most, so a slow call does not slow the rate down (a job
#: waiting for a free slot counts that wait in its latency: its time is taken when it is due).
LOAD_IN_FLIGHT = 16


class StartLog:
    """The job side: `record(index)` takes the time first, then appends `index start`."""

    def __init__(self, path: str | Path) -> None:
        self._file = Path(path).open("a", buffering=1)  # noqa: SIM115  # open for the worker's life

    def record(self, index: int) -> None:
        started = time.time()
        self._file.write(f"{index} {started!r}\n")


def read_starts(path: str | Path) -> dict[int, float]:
    """Start times by job index; a job logged twice raises (it ran twice)."""
    starts: dict[int, float] = {}
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return starts
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2:  # a line being written
            continue
        index = int(parts[0])
        if index in starts:
            raise RuntimeError(f"job {index} started twice")
        starts[index] = float(parts[1])
    return starts


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (`q` in 0..100)."""
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summary(latencies_s: Sequence[float], elapsed_s: float) -> dict[str, float]:
    """p50 / p99 / mean / max in milliseconds, and the enqueue rate achieved."""
    ms = [1000 * x for x in latencies_s]
    return {
        "n": len(ms),
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "mean_ms": sum(ms) / len(ms),
        "max_ms": max(ms),
        "rate_per_s": len(ms) / elapsed_s if elapsed_s > 0 else float("nan"),
    }


Starts = Callable[[], "dict[int, float] | Awaitable[dict[int, float]]"]


async def _wait_started(starts: Starts, indexes: range, deadline: float) -> dict[int, float]:
    while True:
        seen = starts()
        if inspect.isawaitable(seen):
            seen = await seen
        if all(i in seen for i in indexes):
            return seen
        if time.monotonic() > deadline:
            missing = [i for i in indexes if i not in seen]
            raise RuntimeError(f"{len(missing)} jobs never started (first: {missing[:5]})")
        await asyncio.sleep(POLL_S)


async def drive_latency(
    enqueue: Callable[[int], Awaitable[object]],
    starts: Starts,
    *,
    idle_jobs: int,
    gap_s: float,
    load_jobs: int,
    rate: float,
) -> dict[str, Any]:
    """Run the idle phase (indexes 0..idle_jobs-1) then the load phase; return both summaries.

    `enqueue(i)` enqueues job `i`; `starts()` reads the start times logged so far (or returns an
    awaitable of them)."""
    sent: dict[int, float] = {}
    warmup = range(idle_jobs + load_jobs, idle_jobs + load_jobs + WARMUP_JOBS)
    for i in warmup:
        await enqueue(i)
        await _wait_started(starts, range(i, i + 1), time.monotonic() + PHASE_TIMEOUT_S)
    await asyncio.sleep(gap_s)
    began = time.perf_counter()
    for i in range(idle_jobs):
        sent[i] = time.time()
        await enqueue(i)
        await _wait_started(starts, range(i, i + 1), time.monotonic() + PHASE_TIMEOUT_S)
        await asyncio.sleep(gap_s)
    idle_elapsed = time.perf_counter() - began
    load = range(idle_jobs, idle_jobs + load_jobs)
    gate = asyncio.Semaphore(LOAD_IN_FLIGHT)

    async def one(i: int) -> None:
        async with gate:
            await enqueue(i)

    calls: list[asyncio.Task[None]] = []
    began = time.perf_counter()
    for k, i in enumerate(load):
        due = began + k / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        sent[i] = time.time()
        calls.append(asyncio.create_task(one(i)))
    await asyncio.gather(*calls)
    load_elapsed = time.perf_counter() - began
    seen = await _wait_started(starts, load, time.monotonic() + PHASE_TIMEOUT_S)
    idle = [seen[i] - sent[i] for i in range(idle_jobs)]
    return {
        "idle": summary(idle, idle_elapsed),
        "load": summary([seen[i] - sent[i] for i in load], load_elapsed),
    }


def emit(report: dict[str, Any]) -> None:
    """The one JSON line a peer side prints last."""
    print(json.dumps(report), flush=True)
