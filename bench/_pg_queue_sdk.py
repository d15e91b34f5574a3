"""`bench.pg_queue`'s SDK side: real `cv-worker` processes drain a `cv-server` on PostgreSQL.

The same run as `bench.queue`'s on SQLite, on a fresh PostgreSQL schema: N no-op requests are
enqueued first (16 raw HTTP clients, as the raw side does), then `workers` `cv-worker` processes
with `--concurrency` stages at once and `--transport channel|http` drain them (the no-op stage of
`bench._queue_stages` returns the time it ran). The drain is first to last stage start, as the
new peers' is (worker start-up left out); the wall time from the workers' start is printed too.
Before a figure is returned every request must be `done` and claimed exactly once
(`dequeue_count` 1: no lapsed lease was taken over, nothing ran twice).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import asyncpg  # type: ignore[import-untyped]
import psutil  # type: ignore[import-untyped]  # no types-psutil in the dev extras

from bench._procs import ServerProcess
from bench.pg_instances import fresh_schema, with_schema
from bench.queue import start_worker

__all__ = ["SdkDrain", "run_sdk"]

TABLE: Final = "workspace_process_requests"
#: Give up on a drain after this long (a stuck run must not hang the benchmark).
DRAIN_TIMEOUT_S: Final = 900.0
#: How often the bench counts the done rows while the workers drain.
POLL_S: Final = 0.1


@dataclass(frozen=True, slots=True)
class SdkDrain:
    """One SDK-worker drain: seconds, and the CPU per job of each process."""

    enqueue_s: float
    drain_s: float
    wall_s: float
    server_loop_us: float
    server_threads_us: float
    workers_us: float

    def cpu(self) -> str:
        return (
            f"CPU/job: server loop {self.server_loop_us:.0f} us, server threads"
            f" {self.server_threads_us:.0f} us, workers {self.workers_us:.0f} us"
            " (PostgreSQL's own not counted)"
        )


async def _count_done(conn: asyncpg.Connection) -> int:
    return int(await conn.fetchval(f"SELECT count(*) FROM {TABLE} WHERE status = 'done'"))


async def _wait_drained(url: str, jobs: int, procs: list[subprocess.Popen[str]], log: Path
                        ) -> None:  # fmt: skip
    conn = await asyncpg.connect(url)
    try:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while await _count_done(conn) < jobs:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"the drain stalled or a worker exited; see {log}")
            await asyncio.sleep(POLL_S)
    finally:
        await conn.close()


async def _starts_checked(url: str, jobs: int) -> list[float]:
    """Every stage's start time, once every request is done exactly once."""
    conn = await asyncpg.connect(url)
    try:
        row = await conn.fetchrow(
            "SELECT count(*) FILTER (WHERE status = 'done') AS done, count(*) AS total,"
            f" min(dequeue_count) AS least, max(dequeue_count) AS most FROM {TABLE}"
        )
        if (row["done"], row["total"], row["least"], row["most"]) != (jobs, jobs, 1, 1):
            raise RuntimeError(f"drain incomplete or repeated: {dict(row)}")
        return [
            float(json.loads(r["result"])) for r in await conn.fetch(f"SELECT result FROM {TABLE}")
        ]
    finally:
        await conn.close()


#: Enqueues `jobs` no-op requests on the server at (url, token); returns the seconds it took.
Enqueue = Callable[[str, str, int], Coroutine[Any, Any, float]]


def run_sdk(dsn: str, jobs: int, workers: int, concurrency: int, transport: str,
            enqueue: Enqueue) -> SdkDrain:  # fmt: skip
    """Enqueue `jobs` with `enqueue` on a fresh schema, then drain them with `workers` cv-worker
    processes of `concurrency` stages each over `transport` (`channel` or `http`)."""
    with fresh_schema(dsn) as schema, tempfile.TemporaryDirectory(prefix="cv-pg-sdk-") as tmp:
        url = with_schema(dsn, schema)
        server = ServerProcess.start(Path(tmp) / "unused.db", database_url=url)
        procs: list[subprocess.Popen[str]] = []
        log_path = Path(tmp) / "workers.log"
        try:
            enqueue_s = asyncio.run(enqueue(server.url, server.token, jobs))
            main0, other0 = server.cpu_seconds()
            started = time.perf_counter()
            with log_path.open("w") as log:
                extra = ["--transport", transport]
                procs = [
                    start_worker(server.url, server.token, concurrency, f"bench-{k}", log, extra)
                    for k in range(workers)
                ]
            ps = [psutil.Process(p.pid) for p in procs]
            asyncio.run(_wait_drained(url, jobs, procs, log_path))
            wall = time.perf_counter() - started
            worker_cpu = sum(sum(p.cpu_times()[:2]) for p in ps)
            main1, other1 = server.cpu_seconds()
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
            server.stop()
        starts = asyncio.run(_starts_checked(url, jobs))
    return SdkDrain(
        enqueue_s=enqueue_s,
        drain_s=max(starts) - min(starts),
        wall_s=wall,
        server_loop_us=1e6 * (main1 - main0) / jobs,
        server_threads_us=1e6 * (other1 - other0) / jobs,
        workers_us=1e6 * worker_cpu / jobs,
    )
