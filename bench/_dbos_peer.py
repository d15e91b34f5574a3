"""The DBOS side of `bench.queue` (SQLite) and `bench.pg_queue` (PostgreSQL), run by the
interpreter of a throwaway virtualenv that has `dbos` installed (never a dependency of this
project): it imports nothing from the project.

    PYTHON -m bench._dbos_peer SYSTEM_DB_URL JOBS WORKERS CONCURRENCY POLL_S [SCHEMA]
    PYTHON -m bench._dbos_peer latency SYSTEM_DB_URL SCHEMA IDLE_JOBS GAP_S LOAD_JOBS RATE \
        CONCURRENCY POLL_S LOGDIR

(SCHEMA: on PostgreSQL, the schema DBOS's system tables go in; it must be empty.)

One process registers the queue (DBOS's database-backed `register_queue`, `worker_concurrency`
CONCURRENCY, polling every POLL_S seconds), listens to no queue, and enqueues JOBS no-op
workflows one call each, each with its own workflow id (`job-<i>`: DBOS's idempotency key, as our
`job_id` is). Then WORKERS worker processes (each its own executor id, so the concurrency limit
is per process, as `cv-worker --concurrency`) launch DBOS and drain the queue; the parent polls the
system database until every workflow is `SUCCESS`. The no-op workflow returns the time it ran,
so its output is stored, as our `done` row's result is.

Prints one JSON line: enqueue rate, drain seconds (first to last workflow run, the measure
`bench.queue` uses for both other systems), wall seconds with start-up, and, per system table,
how many rows a job left behind (what DBOS persists per job).

`latency` (for `bench.latency`): one worker process (CONCURRENCY at once, polling every POLL_S)
stays up while `bench._peer_common.drive_latency` enqueues one `mark` workflow per call from this
process (an instance that listens to no queue); prints one JSON line.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.metadata
import json
import multiprocessing
import os
import pickle
import sys
import time
from typing import Any

import sqlalchemy as sa  # type: ignore[import-not-found]  # only in the peer's virtualenv
from dbos import DBOS, SetWorkflowID  # type: ignore[import-not-found]

from bench._peer_common import StartLog, drive_latency, emit, read_starts

QUEUE = "bench"
#: Give up on a drain after this long (a stuck run must not hang the benchmark).
DRAIN_TIMEOUT_S = 1800.0


#: The PostgreSQL schema of DBOS's system tables (argv[6], or argv[3] in latency mode; DBOS's
#: default otherwise). Read at import: spawned worker processes see the parent's argv.
LATENCY = len(sys.argv) > 1 and sys.argv[1] == "latency"
SCHEMA = sys.argv[3] if LATENCY else sys.argv[6] if len(sys.argv) > 6 else "dbos"
_STARTS: list[StartLog] = []


def _configure(url: str, executor: str) -> None:
    config: dict[str, Any] = {
        "name": "cvbench",
        "system_database_url": url,
        "executor_id": executor,
        "log_level": "WARNING",
    }
    if not url.startswith("sqlite"):
        config["dbos_system_schema"] = SCHEMA
    DBOS(config=config)

    @DBOS.workflow(name="noop")  # type: ignore[untyped-decorator]
    def noop() -> float:
        return time.time()

    @DBOS.workflow(name="mark")  # type: ignore[untyped-decorator]
    def mark(index: int) -> None:
        if not _STARTS:
            _STARTS.append(StartLog(os.environ["BENCH_LATENCY_LOG"]))
        _STARTS[0].record(index)

    globals()["noop"] = noop
    globals()["mark"] = mark


def _register(concurrency: int, poll_s: float) -> Any:
    return DBOS.register_queue(QUEUE, worker_concurrency=concurrency, polling_interval_sec=poll_s)


def enqueue(url: str, jobs: int, concurrency: int, poll_s: float) -> float:
    _configure(url, "producer")
    DBOS.listen_queues([])
    DBOS.launch()
    queue = _register(concurrency, poll_s)
    started = time.perf_counter()
    for i in range(jobs):
        with SetWorkflowID(f"job-{i}"):
            queue.enqueue(globals()["noop"])
    elapsed = time.perf_counter() - started
    DBOS.destroy()
    return jobs / elapsed


def worker_main(url: str, k: int, concurrency: int, poll_s: float, stop: Any) -> None:
    _configure(url, f"worker-{k}")
    DBOS.launch()
    _register(concurrency, poll_s)
    stop.wait(DRAIN_TIMEOUT_S)
    DBOS.destroy()


def _schema(url: str) -> str | None:
    return None if url.startswith("sqlite") else SCHEMA


def _table(url: str, name: str) -> str:
    schema = _schema(url)
    return f"{schema}.{name}" if schema else name


def _latency_worker(url: str, concurrency: int, poll_s: float, log: str, ready: Any,
                    stop: Any) -> None:  # fmt: skip
    os.environ["BENCH_LATENCY_LOG"] = log
    _configure(url, "worker-0")
    DBOS.launch()
    _register(concurrency, poll_s)
    ready.set()
    stop.wait(DRAIN_TIMEOUT_S)
    DBOS.destroy()


def latency(argv: list[str]) -> None:
    url, _schema_name, idle, gap, load, rate, concurrency, poll, logdir = argv
    log = f"{logdir}/w0.log"
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(
        target=_latency_worker, args=(url, int(concurrency), float(poll), log, ready, stop)
    )
    proc.start()
    try:
        if not ready.wait(120):
            raise SystemExit("the DBOS worker did not get ready")
        _configure(url, "producer")
        DBOS.listen_queues([])
        DBOS.launch()
        queue = _register(int(concurrency), float(poll))

        async def enqueue(index: int) -> None:
            queue.enqueue(globals()["mark"], index)

        report = asyncio.run(
            drive_latency(
                enqueue,
                lambda: read_starts(log),
                idle_jobs=int(idle),
                gap_s=float(gap),
                load_jobs=int(load),
                rate=float(rate),
            )
        )
        DBOS.destroy()
    finally:
        stop.set()
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    emit({"system": "dbos", "version": importlib.metadata.version("dbos"), **report})


def main() -> None:
    if LATENCY:
        latency(sys.argv[2:])
        return
    url, jobs = sys.argv[1], int(sys.argv[2])
    workers, concurrency, poll_s = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:  # its own process: DBOS is one instance per process
        enqueue_per_s = pool.apply(enqueue, (url, jobs, concurrency, poll_s))
    engine = sa.create_engine(url)
    status = _table(url, "workflow_status")
    count = sa.text(f"SELECT count(*) FROM {status} WHERE status = 'SUCCESS' AND queue_name = :q")
    stop = ctx.Event()
    started = time.perf_counter()
    procs = [
        ctx.Process(target=worker_main, args=(url, k, concurrency, poll_s, stop))
        for k in range(workers)
    ]
    for proc in procs:
        proc.start()
    try:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while True:
            with engine.connect() as conn:
                if conn.execute(count, {"q": QUEUE}).scalar_one() >= jobs:
                    break
            if time.monotonic() > deadline or any(not p.is_alive() for p in procs):
                raise SystemExit("the DBOS drain stalled")
            time.sleep(0.05)
        wall_s = time.perf_counter() - started
    finally:
        stop.set()
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    with engine.connect() as conn:
        # Each no-op returned the time it ran; DBOS stores it pickled, base64-encoded (its
        # default serializer). The status rows' timestamps are whole seconds on SQLite.
        times = [
            float(pickle.loads(base64.b64decode(row[0])))
            for row in conn.execute(sa.text(f"SELECT output FROM {_table(url, 'workflow_output')}"))
        ]
        done = conn.execute(count, {"q": QUEUE}).scalar_one()
        rows: dict[str, float] = {}
        for table in sa.inspect(engine).get_table_names(schema=_schema(url)):
            n = conn.execute(sa.text(f"SELECT count(*) FROM {_table(url, table)}")).scalar_one()
            if n >= jobs / 2:  # per-job tables, not DBOS's own bookkeeping
                rows[table] = round(n / jobs, 3)
    drain_s = max(times) - min(times)
    print(
        json.dumps(
            {
                "jobs": jobs,
                "succeeded": done,
                "enqueue_per_s": enqueue_per_s,
                "drain_s": drain_s,
                "wall_s": wall_s,
                "rows_per_job": rows,
                "dbos_version": importlib.metadata.version("dbos"),
            }
        )
    )


if __name__ == "__main__":
    main()
