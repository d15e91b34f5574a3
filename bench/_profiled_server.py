"""Run `cv-server` with cProfile on *every* thread, timing CPU rather than wall time.

    python -m bench._profiled_server OUT_DIR serve --db PATH ...

Plain `python -m cProfile -m cv_server.cli` sees only the event-loop thread, and on a shared
machine its wall-clock timer also charges whatever time the thread spent descheduled. Here each
thread (event loop, SQLite writer, readers) gets its own profiler using `time.thread_time`, so the
numbers are CPU seconds spent in each function, and each thread's stats land in
`OUT_DIR/<thread name>.prof` when the server exits (SIGTERM). Garbage-collector pauses (which
the profiler cannot see) are written to `OUT_DIR/gc.json`: count, total and worst pause per
generation.
"""

from __future__ import annotations

import cProfile
import gc
import json
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from cv_server.cli import main as cli_main

_profiles: list[tuple[str, cProfile.Profile]] = []
_lock = threading.Lock()


class _GcPauses:
    """`gc.callbacks` hook: how long each collection stopped the world, per generation."""

    #: Pauses at least this long are also listed with their wall-clock time.
    LONG_S = 0.05

    def __init__(self) -> None:
        self.started = 0.0
        self.stats: dict[int, dict[str, float]] = {}
        self.long: list[tuple[float, int, float]] = []

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        pause = time.perf_counter() - self.started
        entry = self.stats.setdefault(
            info["generation"], {"count": 0, "total_s": 0.0, "max_s": 0.0, "collected": 0}
        )
        entry["count"] += 1
        entry["total_s"] += pause
        entry["max_s"] = max(entry["max_s"], pause)
        entry["collected"] += info["collected"]
        if pause >= self.LONG_S:
            self.long.append((time.time(), info["generation"], pause))


def _start_thread_profile(frame: FrameType, event: str, arg: Any) -> None:
    """`threading.setprofile` hook: runs once at the start of each new thread and replaces
    itself with a per-thread CPU-time profiler."""
    sys.setprofile(None)
    profile = cProfile.Profile(time.thread_time)
    with _lock:
        _profiles.append((threading.current_thread().name, profile))
    profile.enable()


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    pauses = _GcPauses()
    gc.callbacks.append(pauses)
    threading.setprofile(_start_thread_profile)
    main_profile = cProfile.Profile(time.thread_time)
    main_profile.enable()
    try:
        code = cli_main(argv[1:])
    finally:
        main_profile.disable()
        threading.setprofile(None)  # None unsets the hook for threads started later
        main_profile.dump_stats(out_dir / "event-loop.prof")
        gc.callbacks.remove(pauses)
        report = {"generations": pauses.stats, "long_pauses": pauses.long}
        (out_dir / "gc.json").write_text(json.dumps(report, indent=2) + "\n")
        with _lock:
            profiles = list(_profiles)
        seen: dict[str, int] = {}
        for name, profile in profiles:
            seen[name] = seen.get(name, 0) + 1
            suffix = f"-{seen[name]}" if seen[name] > 1 else ""
            safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
            profile.create_stats()
            profile.dump_stats(out_dir / f"thread-{safe}{suffix}.prof")
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
