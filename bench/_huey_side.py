"""Drive huey for `bench.queue` (run with the huey venv's python, from the repository root).

    python -m bench._huey_side DB JOBS WORKERS
    python -m bench._huey_side latency DB IDLE_JOBS GAP_S LOAD_JOBS RATE LOGFILE

Enqueues JOBS no-op tasks with huey's client API (one producer, one commit each, as an app
would), starts `huey_consumer` with WORKERS worker processes, waits until every task's result is
stored, and prints one JSON line: enqueue rate, drain rate (first to last task execution, the
same measure `bench.queue` uses for cv-workspace), wall time with start-up, and the storage
settings in force.

`latency` (for `bench.latency`): one `huey_consumer` (one worker process, huey's default polling:
0.1 s, backing off x1.15 up to 10 s while idle) stays up while `bench._peer_common.drive_latency`
enqueues one `mark` task per call; prints one JSON line with both phases' summaries.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path


def main(db: str, jobs: int, workers: int) -> int:
    os.environ["BENCH_HUEY_DB"] = db
    from bench._huey_app import huey, noop

    conn = huey.storage.conn
    settings = {
        "journal_mode": conn.execute("pragma journal_mode").fetchone()[0],
        "synchronous": conn.execute("pragma synchronous").fetchone()[0],
        "fsync_option": huey.storage._fsync,
        "huey_version": __import__("huey").__version__,
    }
    began = time.perf_counter()
    for _ in range(jobs):
        noop()
    enqueue_s = time.perf_counter() - began

    consumer = str(Path(sys.executable).with_name("huey_consumer"))
    started = time.perf_counter()
    proc = subprocess.Popen(
        [consumer, "bench._huey_app.huey", "-w", str(workers), "-k", "process", "-q", "-C"],
        env={**os.environ, "BENCH_HUEY_DB": db},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        reader = sqlite3.connect(db, timeout=30)
        deadline = time.monotonic() + 3600
        while reader.execute("select count(*) from kv").fetchone()[0] < jobs:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"huey consumer stopped early (exit {proc.returncode})")
            time.sleep(0.05)
        wall_s = time.perf_counter() - started
        times = [pickle.loads(row[0]) for row in reader.execute("select value from kv")]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    drain_s = max(times) - min(times)
    print(
        json.dumps(
            {
                "jobs": jobs,
                "workers": workers,
                "enqueue_per_s": jobs / enqueue_s,
                "drain_s": drain_s,
                "drain_per_s": (jobs - 1) / drain_s if drain_s > 0 else None,
                "wall_s": wall_s,
                "settings": settings,
            }
        )
    )
    return 0


def latency(db: str, idle: int, gap_s: float, load: int, rate: float, log: str) -> int:
    os.environ["BENCH_HUEY_DB"] = db
    os.environ["BENCH_LATENCY_LOG"] = log
    import asyncio

    from bench._huey_app import mark
    from bench._peer_common import drive_latency, emit, read_starts

    consumer = str(Path(sys.executable).with_name("huey_consumer"))
    proc = subprocess.Popen(
        [consumer, "bench._huey_app.huey", "-w", "1", "-k", "process", "-q", "-C"],
        env=dict(os.environ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    async def enqueue(index: int) -> None:
        mark(index)

    try:
        report = asyncio.run(
            drive_latency(
                enqueue,
                lambda: read_starts(log),
                idle_jobs=idle,
                gap_s=gap_s,
                load_jobs=load,
                rate=rate,
            )
        )
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    emit({"system": "huey", "version": __import__("huey").__version__, **report})
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "latency":
        db, idle, gap, load, rate, log = sys.argv[2:]
        raise SystemExit(latency(db, int(idle), float(gap), int(load), float(rate), log))
    raise SystemExit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
