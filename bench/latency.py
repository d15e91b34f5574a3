"""Queue latency, enqueue → stage start, p50/p99, ours and the peers' in the same run (issue 37).

    .venv/bin/python -m bench.latency [--quick] [--backends sqlite,postgres] [--database-url URL]
                                      [--transport default|http|channel] [--concurrency 16]
                                      [--idle-jobs 100] [--gap 0.05] [--load-jobs 1000] [--rate 100]
                                      [--peers huey,procrastinate,dbos,pgqueuer,oban,graphile]

The enqueuer takes `time.time()` just before each enqueue call; the job takes it first thing when
it runs (ours: the no-op stage of `bench._queue_stages`, whose result is its start time; the peers:
`bench._peer_common.StartLog`). Two phases on one worker process that stays up, started before
the first enqueue:

- *idle*: `--idle-jobs` jobs one at a time: the next is enqueued only once the previous one has
  started and `--gap` seconds have passed, so the worker is idle-waiting each time. This measures
  its wake-up: LISTEN/NOTIFY, a long poll, or a poll interval.
- *load*: `--load-jobs` jobs at a steady `--rate` per second whatever the worker does (the rate
  achieved is printed; a system slower than the rate builds a backlog and its latency grows).

Ours: a `cv-server` on SQLite (WAL, `synchronous=FULL`) and/or PostgreSQL (`--database-url`, a
fresh schema), one `cv-worker` process with `--concurrency` stages at once, enqueues through the
SDK's `QueueClient` (one HTTP call each). `--transport` picks how the worker talks to the server:
`default` is whatever the SDK worker does; `http` and `channel` ask for one (`cv-worker
--transport`), and a worker that has no such option refuses `channel`.

Peers, each from the throwaway environment `bench.queue` / `bench.pg_queue` make (never a
dependency of this project): huey (SQLite, one consumer worker process, its default polling), and
on PostgreSQL procrastinate, DBOS (its queue polled every `--dbos-poll` s), pgqueuer, Oban's Python
port and graphile-worker, each with `--concurrency` jobs at a time in one worker process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import asyncpg  # type: ignore[import-untyped]

from bench import pg_queue
from bench._peer_common import drive_latency
from bench._procs import ServerProcess
from bench.pg_instances import fresh_schema, with_schema
from bench.queue import DEFAULT_DBOS_VENV, DEFAULT_HUEY_VENV, REPO, ensure_dbos, ensure_huey
from cv_workspace_client._queue.requester import QueueClient

WORKSPACE: Final = "bench"
STAGE: Final = "noop"
TABLE: Final = "workspace_process_requests"
PEERS: Final = ("huey", "procrastinate", "dbos", "pgqueuer", "oban", "graphile-worker")
#: Short names `--peers` takes too.
ALIASES: Final = {"graphile": "graphile-worker"}
DEFAULT_DSN: Final = os.environ.get("CV_TEST_DATABASE_URL", "")
#: A peer side that has not reported in this long is stuck.
PEER_TIMEOUT_S: Final = 600


# -- ours ------------------------------------------------------------------------------------------


def _worker_args(transport: str) -> list[str]:
    if transport == "default":
        return []
    help_text = subprocess.run(
        [sys.executable, "-m", "cv_workspace_client.cli", "worker", "--help"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    if "--transport" in help_text:
        return ["--transport", transport]
    if transport == "http":  # a worker without the option speaks HTTP
        return []
    raise SystemExit(f"this cv-worker has no --transport option: cannot ask for {transport!r}")


def _start_worker(url: str, token: str, concurrency: int, extra: list[str], log: Path
                  ) -> subprocess.Popen[str]:  # fmt: skip
    with log.open("w") as sink:
        return subprocess.Popen(
            [
                sys.executable, "-m", "cv_workspace_client.cli", "worker",
                "--url", url, "--token", token,
                "--stages", "bench._queue_stages:STAGES",
                "--concurrency", str(concurrency),
                "--worker-id", "bench-latency",
                "--log-level", "WARNING",
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=sink,
            text=True,
            cwd=REPO,
            start_new_session=True,
        )  # fmt: skip


def _index(job_id: str) -> int:
    return int(job_id[1:])


def _sqlite_starts(db: Path) -> Callable[[], dict[int, float]]:
    def read() -> dict[int, float]:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
            rows = conn.execute(f"SELECT job_id, result FROM {TABLE} WHERE status = 'done'")
            return {_index(job): float(json.loads(result)) for job, result in rows}

    return read


class _PgStarts:
    """Reads the start times on PostgreSQL over one connection, opened on the first read."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._conn: Any = None

    async def __call__(self) -> dict[int, float]:
        if self._conn is None:
            self._conn = await asyncpg.connect(self._url)
        rows = await self._conn.fetch(f"SELECT job_id, result FROM {TABLE} WHERE status = 'done'")
        return {_index(r["job_id"]): float(json.loads(r["result"])) for r in rows}

    async def aclose(self) -> None:
        if self._conn is not None:
            await self._conn.close()


async def _run_ours(server: ServerProcess, starts: Callable[[], Any], args: argparse.Namespace
                    ) -> dict[str, Any]:  # fmt: skip
    try:
        async with QueueClient(server.url, server.token) as client:
            return await drive_latency(
                lambda i: client.enqueue(WORKSPACE, stage=STAGE, job_id=f"j{i}"),
                starts,
                idle_jobs=args.idle_jobs,
                gap_s=args.gap,
                load_jobs=args.load_jobs,
                rate=args.rate,
            )
    finally:
        if isinstance(starts, _PgStarts):
            await starts.aclose()


def run_ours(backend: str, args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    db = directory / f"cv-latency-{backend}.db"
    if backend == "sqlite":
        return _ours_on(db, None, _sqlite_starts(db), args, directory)
    with fresh_schema(args.database_url) as schema:
        url = with_schema(args.database_url, schema)
        return _ours_on(db, url, _PgStarts(url), args, directory)


def _ours_on(db: Path, database_url: str | None, read: Callable[[], Any],
             args: argparse.Namespace, directory: Path) -> dict[str, Any]:  # fmt: skip
    server = ServerProcess.start(db, database_url=database_url)
    try:
        worker = _start_worker(
            server.url, server.token, args.concurrency, args.worker_args, directory / "worker.log"
        )
    except BaseException:
        server.stop()
        raise
    try:
        return asyncio.run(_run_ours(server, read, args))
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
        server.stop()


# -- peers -----------------------------------------------------------------------------------------


def _phase_args(args: argparse.Namespace) -> list[str]:
    return [str(args.idle_jobs), str(args.gap), str(args.load_jobs), str(args.rate)]


def _report(done: subprocess.CompletedProcess[str], name: str) -> dict[str, Any]:
    if done.returncode != 0:
        raise RuntimeError(f"{name} latency run failed: {done.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def run_huey(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    python = ensure_huey(args.huey_venv)
    done = subprocess.run(
        [str(python), "-m", "bench._huey_side", "latency", str(directory / "huey-latency.db"),
         *_phase_args(args), str(directory / "huey-latency.log")],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=PEER_TIMEOUT_S, check=False,
    )  # fmt: skip
    return _report(done, "huey")


def run_procrastinate(args: argparse.Namespace) -> dict[str, Any]:
    python = pg_queue.peer_python(None)
    with fresh_schema(args.database_url) as schema, tempfile.TemporaryDirectory() as logdir:
        done = subprocess.run(
            [python, "-m", "bench._procrastinate_peer", "latency", args.database_url, schema,
             *_phase_args(args), str(args.concurrency), logdir],
            capture_output=True, text=True, cwd=REPO, timeout=PEER_TIMEOUT_S, check=False,
        )  # fmt: skip
    return _report(done, "procrastinate")


def run_dbos(args: argparse.Namespace) -> dict[str, Any]:
    python = ensure_dbos(args.dbos_venv)
    with fresh_schema(args.database_url) as schema, tempfile.TemporaryDirectory() as logdir:
        done = subprocess.run(
            [str(python), "-m", "bench._dbos_peer", "latency", args.database_url, schema,
             *_phase_args(args), str(args.concurrency), str(args.dbos_poll), logdir],
            capture_output=True, text=True, cwd=REPO, timeout=PEER_TIMEOUT_S, check=False,
        )  # fmt: skip
    return _report(done, "DBOS")


def run_new_peer(peer: str, args: argparse.Namespace) -> dict[str, Any]:
    command = pg_queue.peer_command(peer, args.oban_base_python)
    return pg_queue.run_peer_side(
        command, "latency", args.database_url, [*_phase_args(args), str(args.concurrency)]
    )


# -- report ----------------------------------------------------------------------------------------


def _line(name: str, report: dict[str, Any]) -> str:
    idle, load = report["idle"], report["load"]
    return (
        f"  {name:<34} idle p50 {idle['p50_ms']:8.2f} ms  p99 {idle['p99_ms']:8.2f} ms"
        f"   load p50 {load['p50_ms']:8.2f} ms  p99 {load['p99_ms']:8.2f} ms"
        f"  ({load['rate_per_s']:.0f}/s achieved)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.latency", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="50 idle + 500 load jobs")
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--database-url", default=DEFAULT_DSN, help="PostgreSQL, for ours + peers")
    parser.add_argument("--transport", choices=["default", "http", "channel"], default="default")
    parser.add_argument("--concurrency", type=int, default=16, help="jobs at once per worker")
    parser.add_argument("--idle-jobs", type=int, default=100)
    parser.add_argument("--gap", type=float, default=0.05, help="idle: seconds after each start")
    parser.add_argument("--load-jobs", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=100.0, help="load: enqueues per second")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated; '' for none")
    parser.add_argument("--huey-venv", type=Path, default=DEFAULT_HUEY_VENV)
    parser.add_argument("--dbos-venv", type=Path, default=DEFAULT_DBOS_VENV)
    parser.add_argument("--dbos-poll", type=float, default=pg_queue.DEFAULT_DBOS_POLL_S)
    parser.add_argument("--oban-base-python", default=None, help="a Python >= 3.12 for Oban's venv")
    args = parser.parse_args(argv)
    if args.quick:
        args.idle_jobs, args.load_jobs = 50, 500
    backends = [b for b in args.backends.split(",") if b]
    peers = [ALIASES.get(p, p) for p in args.peers.split(",") if p]
    unknown = set(peers) - set(PEERS) or set(backends) - {"sqlite", "postgres"}
    if unknown:
        parser.error(f"unknown {sorted(unknown)}")
    needs_pg = "postgres" in backends or set(peers) - {"huey"}
    if needs_pg and not args.database_url:
        parser.error("PostgreSQL runs need --database-url (or CV_TEST_DATABASE_URL)")
    args.worker_args = _worker_args(args.transport) if backends else []
    print(
        f"enqueue -> stage start; idle: {args.idle_jobs} jobs one at a time, {args.gap} s after"
        f" each start; load: {args.load_jobs} jobs at {args.rate:g}/s; {args.concurrency} at once"
        f" per worker; transport {args.transport}; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="cv-latency-") as tmp:
        directory = Path(tmp)
        for backend in backends:
            began = time.perf_counter()
            report = run_ours(backend, args, directory)
            name = f"cv-workspace, {backend}"
            results[name] = report
            print(_line(name, report) + f"  [{time.perf_counter() - began:.0f} s]", flush=True)
        for peer in peers:
            began = time.perf_counter()
            if peer == "huey":
                report = run_huey(args, directory)
            elif peer == "procrastinate":
                report = run_procrastinate(args)
            elif peer == "dbos":
                report = run_dbos(args)
            else:
                report = run_new_peer(peer, args)
            name = f"{peer}" + (", sqlite" if peer == "huey" else ", postgres")
            results[name] = report
            print(_line(name, report) + f"  [{time.perf_counter() - began:.0f} s]", flush=True)
    peer_rows = {n: r for n, r in results.items() if not n.startswith("cv-workspace")}
    if peer_rows:
        best = min(peer_rows, key=lambda n: peer_rows[n]["idle"]["p50_ms"])
        print(f"best peer idle p50: {best} {peer_rows[best]['idle']['p50_ms']:.2f} ms", flush=True)
        for name, report in results.items():
            if name.startswith("cv-workspace"):
                ratio = report["idle"]["p50_ms"] / peer_rows[best]["idle"]["p50_ms"]
                print(f"  {name} idle p50 / best peer's: {ratio:.2f}x", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
