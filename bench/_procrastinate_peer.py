"""The procrastinate side of `bench.pg_queue`, run by the interpreter of a throwaway virtualenv
that has procrastinate installed (never a dependency of this project): it imports nothing from
the project.

    PYTHON -m bench._procrastinate_peer DSN SCHEMA JOBS WORKERS CONCURRENCY
    PYTHON -m bench._procrastinate_peer latency DSN SCHEMA IDLE_JOBS GAP_S LOAD_JOBS RATE \
        CONCURRENCY LOGDIR

Applies procrastinate's schema in SCHEMA (which must exist and be empty), defers JOBS no-op jobs
in batches, then starts WORKERS worker processes (CONCURRENCY jobs at a time each, LISTEN/NOTIFY
on, as procrastinate ships) that drain the queue and exit once caught up (`wait=False`). Prints
one JSON line: enqueue and drain seconds, and how many jobs ended `succeeded`.

`latency` (for `bench.latency`): one worker (CONCURRENCY jobs at a time, LISTEN/NOTIFY on) stays up
while `bench._peer_common.drive_latency` defers one `mark` job per call; prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import sys
import time
from typing import Any

import procrastinate  # type: ignore[import-not-found]  # only in the peer's virtualenv

from bench._peer_common import StartLog, drive_latency, emit, read_starts

#: Jobs per `batch_defer_async` call while filling the queue.
DEFER_BATCH = 500
_STARTS: list[StartLog] = []


def make_app(dsn: str, schema: str) -> Any:
    connector = procrastinate.PsycopgConnector(
        conninfo=dsn, kwargs={"options": f"-csearch_path={schema}"}, min_size=1, max_size=20
    )
    app = procrastinate.App(connector=connector)

    @app.task(name="noop")  # type: ignore[untyped-decorator]  # procrastinate is untyped here
    async def noop() -> None:
        return None

    @app.task(name="mark")  # type: ignore[untyped-decorator]
    async def mark(index: int) -> None:
        _STARTS[0].record(index)

    return app


async def setup(dsn: str, schema: str, jobs: int) -> float:
    app = make_app(dsn, schema)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        task = app.tasks["noop"]
        started = time.perf_counter()
        for start in range(0, jobs, DEFER_BATCH):
            await task.batch_defer_async(*({} for _ in range(min(DEFER_BATCH, jobs - start))))
        return time.perf_counter() - started


async def work(dsn: str, schema: str, concurrency: int, ready: Any, go: Any) -> None:
    app = make_app(dsn, schema)
    async with app.open_async():
        ready.set()
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        await app.run_worker_async(
            concurrency=concurrency, wait=False, install_signal_handlers=False
        )


def worker_main(dsn: str, schema: str, concurrency: int, ready: Any, go: Any) -> None:
    asyncio.run(work(dsn, schema, concurrency, ready, go))


async def count_succeeded(dsn: str, schema: str) -> int:
    app = make_app(dsn, schema)
    async with app.open_async():
        rows = await app.connector.execute_query_all_async(
            "SELECT count(*) AS n FROM procrastinate_jobs WHERE status = 'succeeded'"
        )
        return int(rows[0]["n"])


async def _latency_worker(dsn: str, schema: str, concurrency: int, log: str, ready: Any) -> None:
    _STARTS.append(StartLog(log))
    app = make_app(dsn, schema)
    async with app.open_async():
        ready.set()
        await app.run_worker_async(concurrency=concurrency, install_signal_handlers=False)


def _latency_worker_main(dsn: str, schema: str, concurrency: int, log: str, ready: Any) -> None:
    asyncio.run(_latency_worker(dsn, schema, concurrency, log, ready))


def latency(argv: list[str]) -> None:
    dsn, schema, idle, gap, load, rate, concurrency, logdir = argv
    log = f"{logdir}/w0.log"

    async def setup_schema() -> None:
        app = make_app(dsn, schema)
        async with app.open_async():
            await app.schema_manager.apply_schema_async()

    asyncio.run(setup_schema())
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(
        target=_latency_worker_main, args=(dsn, schema, int(concurrency), log, ready)
    )
    proc.start()
    if not ready.wait(120):
        raise SystemExit("the procrastinate worker did not get ready")

    async def run() -> dict[str, Any]:
        app = make_app(dsn, schema)
        async with app.open_async():
            task = app.tasks["mark"]
            return await drive_latency(
                lambda i: task.defer_async(index=i),
                lambda: read_starts(log),
                idle_jobs=int(idle),
                gap_s=float(gap),
                load_jobs=int(load),
                rate=float(rate),
            )

    try:
        report = asyncio.run(run())
    finally:
        proc.kill()
        proc.join(30)
    emit({"system": "procrastinate", "version": procrastinate.__version__, **report})


def main() -> None:
    if sys.argv[1] == "latency":
        latency(sys.argv[2:])
        return
    dsn, schema = sys.argv[1], sys.argv[2]
    jobs, workers, concurrency = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    enqueue_s = asyncio.run(setup(dsn, schema, jobs))
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    readies = [ctx.Event() for _ in range(workers)]
    procs = [
        ctx.Process(target=worker_main, args=(dsn, schema, concurrency, ready, go))
        for ready in readies
    ]
    for proc in procs:
        proc.start()
    for ready in readies:
        if not ready.wait(120):
            raise SystemExit("a procrastinate worker did not get ready")
    started = time.perf_counter()
    go.set()
    for proc in procs:
        proc.join(600)
    drain_s = time.perf_counter() - started
    succeeded = asyncio.run(count_succeeded(dsn, schema))
    print(json.dumps({"enqueue_s": enqueue_s, "drain_s": drain_s, "succeeded": succeeded}))


if __name__ == "__main__":
    main()
