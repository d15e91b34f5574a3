"""Work-queue throughput end to end (issue 5): enqueue and drain no-op requests through the real
`cv-server` process and real `cv-worker` processes, next to huey on its SQLite storage, in the
same run.

    .venv/bin/python -m bench.queue [--quick] [--jobs N] [--workers 1,4] [--concurrency 1,16]
                                    [--huey-venv DIR] [--no-huey] [--dir DIR] [--profile DIR]
    .venv/bin/python -m bench.queue --enqueue-only [--quick] [--batch 100] [--batches-in-flight 4]

For each worker-process count, on fresh database files:

- cv-workspace: the server (SQLite, WAL, `synchronous=FULL`) gets `--jobs` enqueues over HTTP (64
  in flight from one client process), then that many `cv-worker` processes (each running up to
  `--concurrency` stages at once) drain them. A no-op stage returns the time it ran.
- huey: `SqliteHuey` with its default storage settings (WAL; `fsync=None` leaves SQLite's
  `synchronous` at its default, FULL — printed from the live connection), `--jobs` enqueues from
  one producer, then `huey_consumer -k process -w N` drains them; the no-op task returns the time
  it ran, so the result is stored (like our `done` row). Installed in a throwaway venv
  (`--huey-venv`, created on first use); never a dependency of this project.
- DBOS: the same `--jobs` no-op workflows enqueued one call each (each with its own workflow id,
  DBOS's idempotency key) on a DBOS `Queue` over a SQLite system database, then that many worker
  processes (each its own executor, `worker_concurrency` = `--concurrency`, polling every
  `--dbos-poll` seconds: DBOS's default is 1 s, which would cap one worker at concurrency 1 near
  one job a second) drain them (`bench._dbos_peer`). Installed in a throwaway venv
  (`--dbos-venv`); never a dependency of this project. Per job DBOS keeps a `workflow_status`
  row (enqueued, claimed, run and finished are each an update of it), a `workflow_input` row and
  a `workflow_output` row; the run prints the rows per table it found.

`--enqueue-only` measures enqueueing alone, side by side: `--jobs` single enqueues over HTTP (64 in
flight), the same number in batches of `--batch` (`enqueue_many`, one HTTP call and one commit
per batch, `--batches-in-flight` at once), each on a fresh server, and huey's enqueue rate (its
run as above; its drain is printed too). No DBOS.

The drain rate is measured the same way for both: jobs / (last task run - first task run), so
process start-up is left out; wall time including start-up is printed too. Each cv-workspace job
is durable at both ends (claimed and done are commits); huey deletes a task when it takes it, so
a crash mid-task loses it — its durability is if anything lower, never higher.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

import psutil  # type: ignore[import-untyped]  # no types-psutil in the dev extras

from bench._procs import MachineLoad, ServerProcess, fsync_probe_ms
from bench._progress import runs
from cv_workspace_client._queue.requester import QueueClient
from cv_workspace_client.queue_models import EnqueueItem

REPO: Final = Path(__file__).resolve().parents[1]
WORKSPACE: Final = "bench"
STAGE: Final = "noop"
HUEY_VERSION: Final = "3.5.4"
DEFAULT_HUEY_VENV: Final = Path(tempfile.gettempdir()) / "huey-venv"
ENQUEUE_IN_FLIGHT: Final = 64
#: Give up on a drain after this long (a stuck run must not hang the benchmark).
DRAIN_TIMEOUT_S: Final = 1800.0
DBOS_REQUIREMENT: Final = "dbos==3.4.0"
DEFAULT_DBOS_VENV: Final = Path(tempfile.gettempdir()) / "cv-bench-dbos"
#: DBOS's queue polling interval for the benchmark (its default is 1 s).
DEFAULT_DBOS_POLL_S: Final = 0.01
TABLE: Final = "workspace_process_requests"


@dataclass
class Result:
    system: str
    workers: int
    concurrency: int
    jobs: int
    enqueue_per_s: float
    drain_s: float
    wall_s: float
    note: str = ""

    @property
    def drain_per_s(self) -> float:
        return (self.jobs - 1) / self.drain_s if self.drain_s > 0 else float("nan")


# -- cv-workspace ----------------------------------------------------------------------------------


async def _enqueue(url: str, token: str, jobs: int) -> float:
    """Enqueue `jobs` deterministic requests, `ENQUEUE_IN_FLIGHT` at a time; return enqueues/s."""
    async with QueueClient(url, token) as client:
        gate = asyncio.Semaphore(ENQUEUE_IN_FLIGHT)

        async def one(i: int) -> None:
            async with gate:
                await client.enqueue(WORKSPACE, stage=STAGE, job_id=f"j{i}")

        began = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(jobs)))
        return jobs / (time.perf_counter() - began)


async def _enqueue_batched(url: str, token: str, jobs: int, batch: int, in_flight: int) -> float:
    """Enqueue `jobs` deterministic requests in batches of `batch` (`enqueue_many`), `in_flight`
    batches at a time; return enqueues/s."""
    async with QueueClient(url, token) as client:
        gate = asyncio.Semaphore(in_flight)

        async def one(start: int) -> None:
            items = [
                EnqueueItem(STAGE, job_id=f"j{i}") for i in range(start, min(jobs, start + batch))
            ]
            async with gate:
                await client.enqueue_many(WORKSPACE, items)

        began = time.perf_counter()
        await asyncio.gather(*(one(start) for start in range(0, jobs, batch)))
        return jobs / (time.perf_counter() - began)


def run_enqueue_only(
    directory: Path, jobs: int, batch: int, in_flight: int
) -> tuple[float, float, str]:
    """Single and batched enqueue rates, each on a fresh server; and the server CPU per enqueue
    of each."""
    rates: list[float] = []
    cpu: list[str] = []
    for name in ("single", "batched"):
        server = ServerProcess.start(directory / f"cv-enqueue-{name}.db")
        try:
            main0, other0 = server.cpu_seconds()
            if name == "single":
                rate = asyncio.run(_enqueue(server.url, server.token, jobs))
            else:
                rate = asyncio.run(
                    _enqueue_batched(server.url, server.token, jobs, batch, in_flight)
                )
            main1, other1 = server.cpu_seconds()
        finally:
            server.stop()
        rates.append(rate)
        per_job = 1e6 * ((main1 - main0) + (other1 - other0)) / jobs
        cpu.append(f"{name} {per_job:.0f} us")
    return rates[0], rates[1], "server CPU/enqueue: " + ", ".join(cpu)


def start_worker(
    url: str, token: str, concurrency: int, name: str, log: IO[str], extra: Sequence[str] = ()
) -> subprocess.Popen[str]:
    """A `cv-worker` process running the no-op stage (`extra`: more of its flags)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cv_workspace_client.cli",
            "worker",
            "--url",
            url,
            "--token",
            token,
            "--stages",
            "bench._queue_stages:STAGES",
            "--concurrency",
            str(concurrency),
            "--worker-id",
            name,
            "--log-level",
            "WARNING",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        cwd=REPO,
        start_new_session=True,
    )
    return proc


def _done_count(db: Path) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        row = conn.execute(f"select count(*) from {TABLE} where status = 'done'").fetchone()
        return int(row[0])


def _run_times(db: Path) -> list[float]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        return [float(json.loads(r[0])) for r in conn.execute(f"select result from {TABLE}")]


def run_ours(
    directory: Path, jobs: int, workers: int, concurrency: int, profile: Path | None
) -> tuple[Result, str]:
    db = directory / f"cv-{workers}x{concurrency}.db"
    server = ServerProcess.start(db, profile_dir=profile)
    procs: list[subprocess.Popen[str]] = []
    log = (directory / f"workers-{workers}x{concurrency}.log").open("w")
    try:
        enqueue_rate = asyncio.run(_enqueue(server.url, server.token, jobs))
        main0, other0 = server.cpu_seconds()
        load0 = MachineLoad.now()
        started = time.perf_counter()
        procs = [
            start_worker(server.url, server.token, concurrency, f"bench-{k}", log)
            for k in range(workers)
        ]
        ps = [psutil.Process(p.pid) for p in procs]
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while _done_count(db) < jobs:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"the drain stalled; see {log.name}")
            time.sleep(0.1)
        wall = time.perf_counter() - started
        worker_cpu = sum(sum(p.cpu_times()[:2]) for p in ps)
        busy, stall = MachineLoad.now().since(load0)
        main1, other1 = server.cpu_seconds()
        times = _run_times(db)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
        server.stop()
    drain = max(times) - min(times)
    cpu = (
        f"CPU/job: server loop {1e6 * (main1 - main0) / jobs:.0f} us, server threads "
        f"{1e6 * (other1 - other0) / jobs:.0f} us, workers {1e6 * worker_cpu / jobs:.0f} us; "
        f"machine busy {busy:.1f} cores"
        + (f", CPU stall {100 * stall:.0f}%" if stall is not None else "")
    )
    return Result("cv-workspace", workers, concurrency, jobs, enqueue_rate, drain, wall), cpu


# -- huey ------------------------------------------------------------------------------------------


def ensure_huey(venv: Path) -> Path:
    """The venv's python, with huey installed (created on first use)."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import huey; print(huey.__version__)"]
    if python.exists() and subprocess.run(probe, capture_output=True, check=False).returncode == 0:
        return python
    print(f"creating {venv} with huey {HUEY_VERSION} (benchmark only)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"huey=={HUEY_VERSION}"], check=True)
    return python


def run_huey(
    python: Path, directory: Path, jobs: int, workers: int
) -> tuple[Result, dict[str, object]]:
    db = directory / f"huey-{workers}.db"
    done = subprocess.run(
        [str(python), "-m", "bench._huey_side", str(db), str(jobs), str(workers)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=DRAIN_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"huey side failed: {done.stderr.strip()[-2000:]}")
    data = json.loads(done.stdout.strip().splitlines()[-1])
    result = Result(
        "huey", workers, 1, jobs, float(data["enqueue_per_s"]), float(data["drain_s"]),
        float(data["wall_s"]),
    )  # fmt: skip
    return result, dict(data["settings"])


# -- DBOS ------------------------------------------------------------------------------------------


def ensure_dbos(venv: Path) -> Path:
    """The venv's python, with DBOS installed (created on first use)."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import dbos"]
    if python.exists() and subprocess.run(probe, capture_output=True, check=False).returncode == 0:
        return python
    print(f"creating {venv} with {DBOS_REQUIREMENT} (benchmark only)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", DBOS_REQUIREMENT, "psycopg[binary]"], check=True
    )
    return python


def run_dbos(
    python: Path, system_db: str, jobs: int, workers: int, concurrency: int, poll_s: float
) -> tuple[Result, dict[str, object]]:
    """Drive `bench._dbos_peer` on `system_db` (a SQLite or PostgreSQL URL); the result and the
    peer's report (rows per job per table, version)."""
    args = [system_db, str(jobs), str(workers), str(concurrency), str(poll_s)]
    done = subprocess.run(
        [str(python), "-m", "bench._dbos_peer", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=DRAIN_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"DBOS side failed: {done.stderr.strip()[-2000:]}")
    data = json.loads(done.stdout.strip().splitlines()[-1])
    if data["succeeded"] != jobs:
        raise RuntimeError(f"DBOS finished {data['succeeded']} of {jobs} workflows")
    result = Result(
        "dbos", workers, concurrency, jobs, float(data["enqueue_per_s"]), float(data["drain_s"]),
        float(data["wall_s"]),
    )  # fmt: skip
    return result, {"rows_per_job": data["rows_per_job"], "version": data["dbos_version"]}


# -- report ----------------------------------------------------------------------------------------


def _row(r: Result) -> str:
    name = f"{r.system}, {r.workers} proc" + (f" x {r.concurrency}" if r.system != "huey" else "")
    return (
        f"  {name:<30} {r.jobs:>7} jobs   enqueue {r.enqueue_per_s:>7,.0f}/s   "
        f"drain {r.drain_per_s:>7,.0f} jobs/s   (wall {r.wall_s:.1f} s)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.queue", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2,000 jobs instead of 20,000")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--workers", default="1,4", help="worker-process counts")
    parser.add_argument("--concurrency", default="1", help="stages at once per cv-worker")
    parser.add_argument("--huey-venv", type=Path, default=DEFAULT_HUEY_VENV)
    parser.add_argument("--no-huey", action="store_true")
    parser.add_argument("--dbos-venv", type=Path, default=DEFAULT_DBOS_VENV)
    parser.add_argument("--dbos-poll", type=float, default=DEFAULT_DBOS_POLL_S)
    parser.add_argument("--no-dbos", action="store_true")
    parser.add_argument("--dir", type=Path, default=None, help="where the databases go")
    parser.add_argument("--profile", type=Path, default=None, help="profile the server into DIR")
    parser.add_argument("--enqueue-only", action="store_true", help="enqueue rates alone")
    parser.add_argument("--batch", type=int, default=100, help="requests per enqueue_many")
    parser.add_argument("--batches-in-flight", type=int, default=4)
    args = parser.parse_args(argv)
    jobs = args.jobs or (2_000 if args.quick else 20_000)
    if args.enqueue_only:
        return _enqueue_only(args, jobs)
    worker_counts = [int(x) for x in args.workers.split(",")]
    concurrencies = [int(x) for x in args.concurrency.split(",")]
    python = None if args.no_huey else ensure_huey(args.huey_venv)
    dbos_python = None if args.no_dbos else ensure_dbos(args.dbos_venv)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        print(
            f"fsync probe {fsync_probe_ms(directory):.2f} ms; load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
            flush=True,
        )
        results: list[Result] = []
        total = len(worker_counts) * (
            len(concurrencies) * (1 + (dbos_python is not None)) + (python is not None)
        )
        with runs(total, "bench.queue") as bar:
            for workers in worker_counts:
                for concurrency in concurrencies:
                    ours, cpu = run_ours(directory, jobs, workers, concurrency, args.profile)
                    results.append(ours)
                    bar.update()
                    print(_row(ours), flush=True)
                    print(f"      {cpu}", flush=True)
                    if dbos_python is not None:
                        name = f"dbos-{workers}x{concurrency}.sqlite"
                        dbos, report = run_dbos(
                            dbos_python, f"sqlite:///{directory / name}", jobs, workers,
                            concurrency, args.dbos_poll,
                        )  # fmt: skip
                        results.append(dbos)
                        bar.update()
                        print(_row(dbos), flush=True)
                        print(f"      dbos, poll {args.dbos_poll} s: {report}", flush=True)
                if python is not None:
                    theirs, settings = run_huey(python, directory, jobs, workers)
                    results.append(theirs)
                    bar.update()
                    print(_row(theirs), flush=True)
                    print(f"      huey storage: {settings}", flush=True)
        if dbos_python is not None:
            print("drain rate, cv-workspace / DBOS (same processes and concurrency):")
            for r in results:
                if r.system != "cv-workspace":
                    continue
                key = (r.workers, r.concurrency)
                peer = next(
                    d for d in results if d.system == "dbos" and (d.workers, d.concurrency) == key
                )
                print(
                    f"  {r.workers} proc x {r.concurrency}: {r.drain_per_s / peer.drain_per_s:.2f}x"
                )
        if python is not None:
            print("drain rate, cv-workspace / huey (same process count):")
            for r in results:
                if r.system != "cv-workspace":
                    continue
                peer = next(h for h in results if h.system == "huey" and h.workers == r.workers)
                print(
                    f"  {r.workers} proc x {r.concurrency}: {r.drain_per_s / peer.drain_per_s:.2f}x"
                )
    return 0


def _enqueue_only(args: argparse.Namespace, jobs: int) -> int:
    python = None if args.no_huey else ensure_huey(args.huey_venv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        print(
            f"fsync probe {fsync_probe_ms(directory):.2f} ms; load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
            flush=True,
        )
        single, batched, cpu = run_enqueue_only(directory, jobs, args.batch, args.batches_in_flight)
        print(f"  cv-workspace, single enqueue ({ENQUEUE_IN_FLIGHT} in flight)"
              f"   {jobs:>7} jobs   enqueue {single:>7,.0f}/s", flush=True)  # fmt: skip
        print(f"  cv-workspace, batches of {args.batch} ({args.batches_in_flight} in flight)"
              f"   {jobs:>7} jobs   enqueue {batched:>7,.0f}/s", flush=True)  # fmt: skip
        print(f"      {cpu}", flush=True)
        if python is not None:
            theirs, settings = run_huey(python, directory, jobs, 1)
            print(_row(theirs), flush=True)
            print(f"      huey storage: {settings}", flush=True)
            print(
                f"enqueue rate / huey: single {single / theirs.enqueue_per_s:.2f}x, "
                f"batched {batched / theirs.enqueue_per_s:.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
