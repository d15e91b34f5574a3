"""Stage execution benchmark (issue 6): the 20 jobs x 5 columns `evaluate` run through real
processes — `cv-server`, the counting fake provider endpoint (50 ms per answer) and N `cv-worker`
processes — as the workers grow 1 -> 2 -> 4 -> 8. Four SDK clients enqueue the same 20 requests at
once. Reports provider calls (must stay at 100: the LLM bill must not scale with workers or
clients) and the wall time from the first enqueue to the last result.

A second table races 80 requests the queue cannot merge (4 clients x 20, non-deterministic ids)
with and without the compute lock: what layer 2 saves.

    .venv/bin/python -m bench.stages [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from bench._progress import runs
from cv_workspace_client.stage import Stage
from cv_workspace_client.stages import enrich, make_evaluate
from tests.acceptance.procs import free_port, mint_cli_token
from tests.acceptance.three_layers_procs import STAGES, Proc, server_cmd, worker_cmd
from tests.acceptance.three_layers_run import WS, RunReport, run_evaluate

JOBS: Final = 20
COLUMNS: Final = 5
CELLS: Final = JOBS * COLUMNS
PROVIDER_DELAY_S: Final = 0.05

#: The anti-pattern, for the comparison only: `evaluate` with a pre-flight check and no lock.
UNLOCKED_STAGES: Final = {"evaluate": Stage(make_evaluate(use_lock=False)), "enrich": Stage(enrich)}


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    workers: int
    requests: int
    report: RunReport
    startup_s: float


def run_once(
    workers: int, *, deterministic: bool = True, stages: str = STAGES, label: str = ""
) -> Row:
    with tempfile.TemporaryDirectory(prefix="bench-stages-") as tmp:
        root = Path(tmp)
        db = root / "cv.db"
        token = mint_cli_token(db, WS)
        began = time.perf_counter()
        server = Proc(server_cmd(db, free_port()), root / "server.log", "listening on")
        provider = Proc(
            ["-m", "cv_workspace_client.stages.fake_provider", "--delay", str(PROVIDER_DELAY_S)],
            root / "provider.log",
            "listening on",
        )
        procs = [server, provider]
        try:
            server.start()
            provider.start()
            fleet = [
                Proc(
                    worker_cmd(server.url, token, provider.url, f"w{i}", 60.0, stages),
                    root / f"worker{i}.log",
                    "ready",
                ).spawn()
                for i in range(workers)
            ]
            procs += fleet
            for proc in fleet:
                proc.wait_ready()
            startup = time.perf_counter() - began
            report = asyncio.run(
                run_evaluate(
                    server.url,
                    token,
                    provider.url,
                    jobs=JOBS,
                    column_count=COLUMNS,
                    deterministic=deterministic,
                )
            )
        finally:
            for proc in reversed(procs):
                proc.stop()
    return Row(label, workers, len(report.outcomes), report, startup)


def show(row: Row) -> None:
    r = row.report
    duplicates = len(r.log_cells) - len(set(r.log_cells))
    print(
        f"{row.label:<22}{row.workers:>3} workers {row.requests:>4} requests "
        f"{r.provider_calls:>5} provider calls {len(r.log_cells):>5} cell writes "
        f"({duplicates} twice) {r.wall_seconds:>7.2f} s wall "
        f"{row.requests / r.wall_seconds:>7.1f} stages/s",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.stages", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1 and 8 workers, no comparison")
    args = parser.parse_args(argv)
    sizes = [1, 8] if args.quick else [1, 2, 4, 8]
    print(
        f"{JOBS} jobs x {COLUMNS} columns = {CELLS} cells, provider {PROVIDER_DELAY_S * 1000:.0f} "
        "ms per call, 4 clients enqueueing the same requests"
    )
    ok = True
    with runs(len(sizes), "bench.stages") as bar:
        for workers in sizes:
            row = run_once(workers, label="evaluate")
            bar.update()
            show(row)
            ok &= row.report.provider_calls == CELLS
    if not args.quick:
        print("\n80 requests the queue cannot merge (4 clients x 20, non-deterministic ids):")
        locked = run_once(8, deterministic=False, label="with compute_lock")
        show(locked)
        ok &= locked.report.provider_calls == CELLS
        unlocked = "bench.stages:UNLOCKED_STAGES"
        show(run_once(8, deterministic=False, stages=unlocked, label="without (anti-pattern)"))
    if not ok:
        print("FAILED: provider calls != cells", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
