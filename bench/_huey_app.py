"""The huey side of `bench.queue`: a `SqliteHuey` on the file named by `BENCH_HUEY_DB`, and the
no-op task. Imported by huey's own consumer, in the throwaway venv where huey is installed (huey
is never a dependency of this project).

Storage settings are huey's defaults (`SqliteStorage`: `journal_mode="wal"`, `fsync=None`, which
leaves SQLite's own `synchronous` setting alone — FULL unless the build changed it; the driver
prints what the connection actually runs with).
"""

from __future__ import annotations

import os
import time

from huey import SqliteHuey  # type: ignore[import-not-found]  # bench-only venv

from bench._peer_common import StartLog

huey = SqliteHuey("bench", filename=os.environ.get("BENCH_HUEY_DB", "huey-bench.db"))
_STARTS: list[StartLog] = []


@huey.task()  # type: ignore[untyped-decorator]
def noop() -> float:
    return time.time()


@huey.task()  # type: ignore[untyped-decorator]
def mark(index: int) -> None:
    """`bench.latency`'s job: log its start time to the file named by `BENCH_LATENCY_LOG`."""
    if not _STARTS:
        _STARTS.append(StartLog(os.environ["BENCH_LATENCY_LOG"]))
    _STARTS[0].record(index)
