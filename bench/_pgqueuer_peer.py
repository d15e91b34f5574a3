"""The pgqueuer side of `bench.pg_queue` and `bench.latency`, run by the interpreter of a throwaway
virtualenv that has pgqueuer installed (never a dependency of this project): it imports nothing
from the project but the standard-library helpers of `bench._peer_common`.

    PYTHON -m bench._pgqueuer_peer drain DSN SCHEMA JOBS WORKERS CONCURRENCY LOGDIR
    PYTHON -m bench._pgqueuer_peer latency DSN SCHEMA IDLE_JOBS GAP_S LOAD_JOBS RATE CONCURRENCY \
        LOGDIR

Installs pgqueuer's tables in SCHEMA (which must exist and be empty; asyncpg connections with that
`search_path`). *drain*: enqueues JOBS no-op jobs in batches (one `enqueue` call with lists, one
INSERT per batch), then WORKERS worker processes drain them with pgqueuer's own drain mode
(`QueueExecutionMode.drain`: exit once the queue is empty; LISTEN/NOTIFY on, as it ships).
Concurrency 1 is `batch_size=1` with the entrypoint's `concurrency_limit` = WORKERS (pgqueuer
refuses a `max_concurrent_tasks` below twice the batch, and its entrypoint limit holds across all
workers: WORKERS jobs at once in all, as many as one at a time each); concurrency C > 1 is
`max_concurrent_tasks=C` with batches of C // 2. *latency*: one worker stays up while
`bench._peer_common.drive_latency` enqueues one job per call.

Each job logs its index and start time (`StartLog`); a job run twice or missing fails the run.
Prints one JSON line; drain seconds are first to last job start (as `bench.queue` measures huey
and DBOS), and per table the rows a job left behind after the drain (what pgqueuer persists).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import multiprocessing
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-not-found,import-untyped,unused-ignore]  # peer venv only
from pgqueuer import PgQueuer  # type: ignore[import-not-found]  # only in the peer's virtualenv
from pgqueuer.db import AsyncpgDriver, AsyncpgPoolDriver  # type: ignore[import-not-found]
from pgqueuer.models import Job  # type: ignore[import-not-found]
from pgqueuer.queries import Queries  # type: ignore[import-not-found]
from pgqueuer.types import QueueExecutionMode  # type: ignore[import-not-found]

from bench._peer_common import StartLog, drive_latency, emit, read_starts

ENTRYPOINT = "noop"
#: Jobs per `enqueue` call while filling the queue.
ENQUEUE_BATCH = 500
#: A worker that cannot finish its drain in this long is stuck.
DRAIN_TIMEOUT_S = 900.0


async def _connect(dsn: str, schema: str) -> Any:
    return await asyncpg.connect(dsn, server_settings={"search_path": schema})


def _worker_knobs(concurrency: int, workers: int) -> tuple[int, int | None, int]:
    """(batch_size, max_concurrent_tasks, entrypoint concurrency_limit) of each worker."""
    if concurrency <= 1:
        return 1, None, workers
    return max(1, concurrency // 2), concurrency, 0


async def _work(dsn: str, schema: str, concurrency: int, workers: int, log: str, drain: bool,
                ready: Any, go: Any) -> None:  # fmt: skip
    conn = await _connect(dsn, schema)
    pgq = PgQueuer(AsyncpgDriver(conn))
    starts = StartLog(log)
    batch, max_tasks, limit = _worker_knobs(concurrency, workers)

    @pgq.entrypoint(ENTRYPOINT, concurrency_limit=limit)  # type: ignore[untyped-decorator]
    async def noop(job: Job) -> None:
        starts.record(int(job.payload))

    ready.set()
    await asyncio.get_running_loop().run_in_executor(None, go.wait)
    await pgq.run(
        dequeue_timeout=timedelta(seconds=30),
        batch_size=batch,
        max_concurrent_tasks=max_tasks,
        mode=QueueExecutionMode.drain if drain else QueueExecutionMode.continuous,
    )
    await conn.close()


def _worker_main(dsn: str, schema: str, concurrency: int, workers: int, log: str, drain: bool,
                 ready: Any, go: Any) -> None:  # fmt: skip
    asyncio.run(_work(dsn, schema, concurrency, workers, log, drain, ready, go))


async def _install(dsn: str, schema: str) -> None:
    conn = await _connect(dsn, schema)
    try:
        await Queries(AsyncpgDriver(conn)).install()
    finally:
        await conn.close()


async def _enqueue_all(dsn: str, schema: str, jobs: int) -> float:
    conn = await _connect(dsn, schema)
    try:
        queries = Queries(AsyncpgDriver(conn))
        started = time.perf_counter()
        for first in range(0, jobs, ENQUEUE_BATCH):
            indexes = range(first, min(jobs, first + ENQUEUE_BATCH))
            await queries.enqueue(
                [ENTRYPOINT] * len(indexes), [str(i).encode() for i in indexes], [0] * len(indexes)
            )
        return time.perf_counter() - started
    finally:
        await conn.close()


async def _rows_per_job(dsn: str, schema: str, jobs: int) -> dict[str, float]:
    conn = await _connect(dsn, schema)
    try:
        tables = await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = $1 ORDER BY 1", schema
        )
        rows: dict[str, float] = {}
        for record in tables:
            name = record["tablename"]
            n = await conn.fetchval(f'SELECT count(*) FROM {schema}."{name}"')
            rows[name] = round(n / jobs, 3)
        return rows
    finally:
        await conn.close()


def _start_workers(
    dsn: str, schema: str, workers: int, concurrency: int, logdir: Path, drain: bool
) -> tuple[list[Any], Any]:
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    readies = [ctx.Event() for _ in range(workers)]
    procs = [
        ctx.Process(
            target=_worker_main,
            args=(dsn, schema, concurrency, workers, str(logdir / f"w{k}.log"), drain, ready, go),
        )
        for k, ready in enumerate(readies)
    ]
    for proc in procs:
        proc.start()
    if not all(ready.wait(120) for ready in readies):
        raise SystemExit("a pgqueuer worker did not get ready")
    return procs, go


def _all_starts(logdir: Path) -> dict[int, float]:
    merged: dict[int, float] = {}
    for log in sorted(logdir.glob("w*.log")):
        for index, started in read_starts(log).items():
            if index in merged:
                raise RuntimeError(f"job {index} started twice")
            merged[index] = started
    return merged


def drain(dsn: str, schema: str, jobs: int, workers: int, concurrency: int, logdir: Path) -> None:
    asyncio.run(_install(dsn, schema))
    enqueue_s = asyncio.run(_enqueue_all(dsn, schema, jobs))
    procs, go = _start_workers(dsn, schema, workers, concurrency, logdir, drain=True)
    started = time.perf_counter()
    go.set()
    for proc in procs:
        proc.join(DRAIN_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            raise SystemExit("a pgqueuer worker did not finish its drain")
    wall_s = time.perf_counter() - started
    starts = _all_starts(logdir)
    if sorted(starts) != list(range(jobs)):
        raise SystemExit(f"pgqueuer ran {len(starts)} distinct jobs of {jobs}")
    emit(
        {
            "system": "pgqueuer",
            "version": importlib.metadata.version("pgqueuer"),
            "succeeded": len(starts),
            "enqueue_s": enqueue_s,
            "drain_s": max(starts.values()) - min(starts.values()),
            "wall_s": wall_s,
            "rows_per_job": asyncio.run(_rows_per_job(dsn, schema, jobs)),
        }
    )


def latency(dsn: str, schema: str, idle: int, gap_s: float, load: int, rate: float,
            concurrency: int, logdir: Path) -> None:  # fmt: skip
    asyncio.run(_install(dsn, schema))
    procs, go = _start_workers(dsn, schema, 1, concurrency, logdir, drain=False)
    go.set()

    async def run() -> dict[str, Any]:
        # A pool: the load phase has several enqueue calls in flight.
        pool = await asyncpg.create_pool(
            dsn, server_settings={"search_path": schema}, min_size=1, max_size=8
        )
        queries = Queries(AsyncpgPoolDriver(pool))
        try:
            return await drive_latency(
                lambda i: queries.enqueue(ENTRYPOINT, str(i).encode()),
                lambda: _all_starts(logdir),
                idle_jobs=idle,
                gap_s=gap_s,
                load_jobs=load,
                rate=rate,
            )
        finally:
            await pool.close()

    try:
        report = asyncio.run(run())
    finally:
        for proc in procs:
            proc.kill()
            proc.join(30)
    emit({"system": "pgqueuer", "version": importlib.metadata.version("pgqueuer"), **report})


def main() -> None:
    mode, dsn, schema, *rest = sys.argv[1:]
    if mode == "drain":
        jobs, workers, concurrency, logdir = rest
        drain(dsn, schema, int(jobs), int(workers), int(concurrency), Path(logdir))
    else:
        idle, gap, load, rate, concurrency, logdir = rest
        latency(dsn, schema, int(idle), float(gap), int(load), float(rate), int(concurrency),
                Path(logdir))  # fmt: skip


if __name__ == "__main__":
    main()
