"""`python -m tests.chaos --backend sqlite|postgres --seconds S --seed N`: one chaos run.

Prints the fault log (each fault with its time) and then, last, the figure line. Exits 0 when
every invariant held; otherwise prints each violation, the seed to repeat the run with and the
directory holding every process's log (kept), and exits 1. PostgreSQL runs in a fresh schema of
`--database-url` (default `$CV_TEST_DATABASE_URL`), dropped afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path

from tests.chaos.harness import ChaosResult, ChaosSpec, run_chaos, run_in_schema


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--backend", choices=["sqlite", "postgres"], required=True)
    parser.add_argument("--seconds", type=float, required=True, help="length of the fault phase")
    parser.add_argument("--seed", type=int, required=True, help="the fault schedule's seed")
    parser.add_argument(
        "--database-url",
        default=os.environ.get("CV_TEST_DATABASE_URL"),
        help="PostgreSQL DSN (postgres; default $CV_TEST_DATABASE_URL)",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="where logs go (kept)")
    parser.add_argument("--writer-rate", type=float, default=12.0, help="ops/s per writer")
    parser.add_argument(
        "--worker-transport",
        choices=["channel", "http"],
        default="channel",
        help="how the workers claim and report: their worker channel, or the HTTP verbs",
    )
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        parser.error("--seconds must be > 0")
    if args.backend == "postgres" and not args.database_url:
        parser.error("postgres needs --database-url or $CV_TEST_DATABASE_URL")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="cv-chaos-"))
    spec = ChaosSpec(
        backend=args.backend,
        seconds=args.seconds,
        seed=args.seed,
        workdir=workdir,
        writer_rate=args.writer_rate,
        worker_transport=args.worker_transport,
    )
    result = asyncio.run(_run(spec, args.database_url))
    for line in result.history.fault_log:
        print(line)
    if not result.verdict.ok:
        for violation in result.verdict.violations:
            print(f"VIOLATION: {violation}")
        print(
            f"repeat with: --backend {spec.backend} --seconds {spec.seconds:g} --seed {spec.seed}"
        )
        print(f"logs kept in {workdir}")
    elif args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    print(result.figure_line)
    sys.stdout.flush()
    return 0 if result.verdict.ok else 1


async def _run(spec: ChaosSpec, database_url: str | None) -> ChaosResult:
    if spec.backend == "sqlite":
        return await run_chaos(spec)
    assert database_url is not None

    async def body(url: str) -> ChaosResult:
        return await run_chaos(ChaosSpec(**{**spec.__dict__, "database_url": url}))

    return await run_in_schema(database_url, body)


if __name__ == "__main__":
    raise SystemExit(main())
