"""The Oban side of `bench.pg_queue` and `bench.latency` (PyPI `oban`, Oban's Python port), run by
the interpreter of a throwaway virtualenv that has it installed (never a dependency of this
project; it needs Python 3.12 or later): it imports nothing from the project but the
standard-library helpers of `bench._peer_common`.

    PYTHON -m bench._oban_peer drain DSN SCHEMA JOBS WORKERS CONCURRENCY LOGDIR
    PYTHON -m bench._oban_peer latency DSN SCHEMA IDLE_JOBS GAP_S LOAD_JOBS RATE CONCURRENCY \
        LOGDIR

Installs Oban's tables in SCHEMA (its `prefix`; the schema must exist and be empty). *drain*:
enqueues JOBS no-op jobs with `enqueue_many` in batches, then WORKERS processes, each an Oban
node running the queue with `limit` CONCURRENCY (its per-node concurrency; LISTEN/NOTIFY
notifier and leader election on, as it ships), drain them; the parent polls until every job is
`completed`, then stops the nodes. *latency*: one node stays up while
`bench._peer_common.drive_latency` enqueues one job per call.

Each job logs its index and start time (`StartLog`); a job run twice or missing fails the run, and
so does a job whose `attempt` is not 1. Prints one JSON line; drain seconds are first to last job
start (as `bench.queue` measures huey and DBOS), and per table the rows a job left behind after
the drain (what Oban persists).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

import psycopg  # type: ignore[import-not-found,unused-ignore]  # only in the peer's virtualenv
from oban import Oban, worker  # type: ignore[import-not-found]
from oban.schema import install_sql  # type: ignore[import-not-found]

from bench._peer_common import StartLog, drive_latency, emit, read_starts

QUEUE = "bench"
ENQUEUE_BATCH = 500
DRAIN_TIMEOUT_S = 900.0
_STARTS: list[StartLog] = []


@worker(queue=QUEUE)
class Noop:
    async def process(self, job: Any) -> None:
        _STARTS[0].record(int(job.args["i"]))


def _job(index: int) -> Any:
    return Noop.new({"i": index})  # type: ignore[attr-defined]  # added by @worker


async def _pool(dsn: str, size: int = 4) -> Any:
    return await Oban.create_pool(dsn, min_size=1, max_size=size)


async def _install(dsn: str, schema: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(install_sql(schema))


async def _enqueue_all(dsn: str, schema: str, jobs: int) -> float:
    pool = await _pool(dsn)
    try:
        oban = Oban(pool=pool, prefix=schema, name="producer")
        started = time.perf_counter()
        for first in range(0, jobs, ENQUEUE_BATCH):
            batch = [_job(i) for i in range(first, min(jobs, first + ENQUEUE_BATCH))]
            await oban.enqueue_many(batch)
        return time.perf_counter() - started
    finally:
        await pool.close()


async def _work(dsn: str, schema: str, k: int, concurrency: int, log: str, ready: Any,
                stop: Any) -> None:  # fmt: skip
    _STARTS.append(StartLog(log))
    pool = await _pool(dsn, size=max(4, min(concurrency + 2, 20)))
    oban = Oban(pool=pool, prefix=schema, queues={QUEUE: concurrency}, node=f"bench-{k}")
    await oban.start()
    ready.set()
    await asyncio.get_running_loop().run_in_executor(None, stop.wait, DRAIN_TIMEOUT_S)
    await oban.stop()
    await pool.close()


def _worker_main(dsn: str, schema: str, k: int, concurrency: int, log: str, ready: Any,
                 stop: Any) -> None:  # fmt: skip
    asyncio.run(_work(dsn, schema, k, concurrency, log, ready, stop))


def _all_starts(logdir: Path) -> dict[int, float]:
    merged: dict[int, float] = {}
    for log in sorted(logdir.glob("w*.log")):
        for index, started in read_starts(log).items():
            if index in merged:
                raise RuntimeError(f"job {index} started twice")
            merged[index] = started
    return merged


async def _state(dsn: str, schema: str) -> tuple[int, int]:
    """(completed jobs, jobs with more than one attempt)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            f"SELECT count(*) FILTER (WHERE state = 'completed'),"
            f" count(*) FILTER (WHERE attempt > 1) FROM {schema}.oban_jobs"
        )
        row = await cur.fetchone()
        assert row is not None
        return int(row[0]), int(row[1])


async def _rows_per_job(dsn: str, schema: str, jobs: int) -> dict[str, float]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s ORDER BY 1", (schema,)
        )
        rows: dict[str, float] = {}
        for (name,) in await cur.fetchall():
            n = await (await conn.execute(f'SELECT count(*) FROM {schema}."{name}"')).fetchone()
            rows[name] = round(n[0] / jobs, 3)
        return rows


def _start_nodes(dsn: str, schema: str, workers: int, concurrency: int, logdir: Path
                 ) -> tuple[list[Any], Any]:  # fmt: skip
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    readies = [ctx.Event() for _ in range(workers)]
    procs = [
        ctx.Process(
            target=_worker_main,
            args=(dsn, schema, k, concurrency, str(logdir / f"w{k}.log"), ready, stop),
        )
        for k, ready in enumerate(readies)
    ]
    for proc in procs:
        proc.start()
    if not all(ready.wait(120) for ready in readies):
        stop.set()
        raise SystemExit("an Oban node did not get ready")
    return procs, stop


def _stop_nodes(procs: list[Any], stop: Any) -> None:
    stop.set()
    for proc in procs:
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def drain(dsn: str, schema: str, jobs: int, workers: int, concurrency: int, logdir: Path) -> None:
    asyncio.run(_install(dsn, schema))
    enqueue_s = asyncio.run(_enqueue_all(dsn, schema, jobs))
    started = time.perf_counter()
    procs, stop = _start_nodes(dsn, schema, workers, concurrency, logdir)
    try:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while asyncio.run(_state(dsn, schema))[0] < jobs:
            if time.monotonic() > deadline or any(not p.is_alive() for p in procs):
                raise SystemExit("the Oban drain stalled")
            time.sleep(0.05)
        wall_s = time.perf_counter() - started
    finally:
        _stop_nodes(procs, stop)
    starts = _all_starts(logdir)
    completed, retried = asyncio.run(_state(dsn, schema))
    if sorted(starts) != list(range(jobs)) or completed != jobs or retried:
        raise SystemExit(f"Oban ran {len(starts)} distinct jobs of {jobs}, {retried} retried")
    emit(
        {
            "system": "oban",
            "version": importlib.metadata.version("oban"),
            "succeeded": completed,
            "enqueue_s": enqueue_s,
            "drain_s": max(starts.values()) - min(starts.values()),
            "wall_s": wall_s,
            "rows_per_job": asyncio.run(_rows_per_job(dsn, schema, jobs)),
        }
    )


def latency(dsn: str, schema: str, idle: int, gap_s: float, load: int, rate: float,
            concurrency: int, logdir: Path) -> None:  # fmt: skip
    asyncio.run(_install(dsn, schema))
    procs, stop = _start_nodes(dsn, schema, 1, concurrency, logdir)

    async def run() -> dict[str, Any]:
        pool = await _pool(dsn)
        oban = Oban(pool=pool, prefix=schema, name="producer")
        try:
            return await drive_latency(
                lambda i: oban.enqueue(_job(i)),
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
        _stop_nodes(procs, stop)
    emit({"system": "oban", "version": importlib.metadata.version("oban"), **report})


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
