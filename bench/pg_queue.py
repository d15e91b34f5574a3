"""Queue drain on PostgreSQL, next to its PostgreSQL peers on the same database in the same run.

    python -m bench.pg_queue --database-url postgresql://postgres@127.0.0.1:5432/test [--quick]
                             [--jobs 4000] [--workers 4] [--batches 1,16,64]
                             [--peer-concurrency 1,64] [--rounds 1] [--procrastinate-python PATH]
                             [--peers procrastinate,dbos,pgqueuer,oban,graphile-worker]
                             [--ours-worker sdk,raw] [--transport channel,http]

cv-workspace: one `cv-server` on PostgreSQL (fresh schema); N no-op requests enqueued through
`POST /v1/workspaces/{ws}/requests` by 16 concurrent clients; then one of two drains
(`--ours-worker`, both if asked):

`sdk` (the default): `--workers` real `cv-worker` processes, each with `--concurrency` set to each
of `--peer-concurrency` in turn (the peers' figure at the same concurrency is its yardstick), over
`--transport` (`channel`, the worker's default: one long-lived connection per worker; `http`: a
request per claim and report; `channel,http`: both, one after the other). Drain from first to
last stage start, as the new peers' (`bench._pg_queue_sdk`).

`raw`: `--workers` processes of the bench's own HTTP drainer, through the HTTP worker routes —
with batch 1, `POST /v1/queue/claim` and the request's own `.../complete` (one claim and one
complete per job, as a plain worker does); with batch B > 1 (`--batches`), `claim` with `limit: B`
and `POST /v1/queue/complete` (one commit per batch). Each worker stops at its first empty claim
(everything was enqueued before the drain began).

procrastinate: the same N no-op jobs deferred in batches into its own fresh schema, then as many
worker processes (`wait=False`: exit once caught up, LISTEN/NOTIFY on) drain them, each running
one job at a time (`concurrency=1`, as our batch 1) or several (`--peer-concurrency`: its way of
keeping more jobs in flight per worker, as our batches do). It runs from a throwaway virtualenv
(`--procrastinate-python`, or one this script creates under the temp dir): never a dependency of
this project.

DBOS (`bench._dbos_peer`), pgqueuer (`bench._pgqueuer_peer`), Oban's Python port
(`bench._oban_peer`, PyPI `oban`, Python 3.12 or later) and graphile-worker
(`bench._graphile_peer.js`, Node, npm) drain the same N no-op jobs on the same database, each in a
fresh schema, each from a throwaway environment this script makes under the temp dir (a virtualenv,
or an npm prefix): never a dependency of this project. `--peers` picks them. Each worker process
runs one job at a time (`--peer-concurrency` 1) or several (each peer's own knob, named in its
module). Each prints, per table, the rows a job left behind after the drain: what it persists per
job.

Every side is checked after the drain (every job done exactly once: the new peers log each job's
start and fail on a job run twice or never) before a figure is printed. All are durable
(`synchronous_commit` as configured, printed; none uses unlogged tables). The new peers' drain is
first to last job start, as `bench.queue` measures huey and DBOS, and so is the sdk side's; the
raw side's and procrastinate's is the whole drain from the go signal (the raw side therefore counts
its first claim and last completion too).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

import asyncpg  # type: ignore[import-untyped]

from bench._pg_queue_sdk import run_sdk
from bench.pg_instances import RawPoster, Server, cli, fresh_schema, pg_setting, with_schema

WORKSPACE: Final = "bench"
STAGE: Final = "noop"
ENQUEUERS: Final = 16
PEER_REQUIREMENT: Final = "procrastinate[psycopg]==3.10.0"
DBOS_REQUIREMENTS: Final = ("dbos==3.4.0", "psycopg[binary]")
#: DBOS's queue polling interval for the benchmark (its default is 1 s).
DEFAULT_DBOS_POLL_S: Final = 0.01
PGQUEUER_REQUIREMENTS: Final = ("pgqueuer==1.6.0", "asyncpg")
OBAN_REQUIREMENT: Final = "oban==0.7.0"
GRAPHILE_REQUIREMENT: Final = "graphile-worker@0.18.0"
PEERS: Final = ("procrastinate", "dbos", "pgqueuer", "oban", "graphile-worker")
REPO: Final = Path(__file__).resolve().parent.parent
PEER_TIMEOUT_S: Final = 1800


# -- cv-workspace ----------------------------------------------------------------------------------


async def _enqueue(url: str, token: str, jobs: int) -> float:
    started = time.perf_counter()
    path = f"/v1/workspaces/{WORKSPACE}/requests"

    async def enqueuer(first: int) -> None:
        poster = RawPoster(url, token)
        try:
            for i in range(first, jobs, ENQUEUERS):
                body = json.dumps({"stage": STAGE, "job_id": f"job-{i}"}).encode()
                status, answer = await poster.post(path, body)
                if status != 202:
                    raise RuntimeError(f"enqueue refused: {status} {answer}")
        finally:
            poster.close()

    await asyncio.gather(*(enqueuer(k) for k in range(ENQUEUERS)))
    return time.perf_counter() - started


async def _drain(url: str, token: str, batch: int, worker: int) -> int:
    poster = RawPoster(url, token)
    claim: dict[str, Any] = {"worker_classes": [STAGE], "worker_id": f"bench-{worker}"}
    if batch > 1:
        claim["limit"] = batch
    claim_body = json.dumps(claim).encode()
    done = 0
    try:
        while True:
            status, answer = await poster.post("/v1/queue/claim", claim_body)
            if status == 204:
                return done
            if status != 200:
                raise RuntimeError(f"claim refused: {status} {answer}")
            if batch == 1:
                row = answer["request"]
                path = f"/v1/workspaces/{row['workspace_id']}/requests/{row['request_id']}/complete"
                body = {"claim_token": row["claim_token"], "result": None}
            else:
                rows = answer["requests"]
                path = "/v1/queue/complete"
                body = {
                    "completions": [
                        {"request_id": r["request_id"], "claim_token": r["claim_token"]}
                        for r in rows
                    ]
                }
            status, answer = await poster.post(path, json.dumps(body).encode())
            if status != 200:
                raise RuntimeError(f"complete refused: {status} {answer}")
            done += 1 if batch == 1 else len(body["completions"])
    finally:
        poster.close()


def _drain_process(
    url: str, token: str, batch: int, worker: int, ready: Any, go: Any, out: Any
) -> None:
    # Imported and waiting: the clock starts when every worker is. The connection opens with
    # the first claim, as a worker starting up pays it.
    ready.set()
    go.wait(120)
    out.put(asyncio.run(_drain(url, token, batch, worker)))


async def _check_done(database_url: str, jobs: int) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow(
            "SELECT count(*) FILTER (WHERE status = 'done') AS done,"
            " count(*) AS total, max(dequeue_count) AS dequeues FROM workspace_process_requests"
        )
    finally:
        await conn.close()
    if (row["done"], row["total"], row["dequeues"]) != (jobs, jobs, 1):
        raise RuntimeError(f"drain incomplete or repeated: {dict(row)}")


def run_ours(dsn: str, jobs: int, workers: int, batch: int) -> tuple[float, float]:
    """(enqueue seconds, drain seconds) for cv-workspace."""
    with fresh_schema(dsn) as schema:
        url = with_schema(dsn, schema)
        subprocess.run(cli("init", "--database-url", url), check=True, timeout=60)
        token = subprocess.run(
            cli("token", "--database-url", url, "--workspace", "*"),
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
        server = Server.start(url)
        try:
            enqueue_s = asyncio.run(_enqueue(server.url, token, jobs))
            ctx = multiprocessing.get_context("spawn")
            go, out = ctx.Event(), ctx.Queue()
            readies = [ctx.Event() for _ in range(workers)]
            procs = [
                ctx.Process(
                    target=_drain_process, args=(server.url, token, batch, w, ready, go, out)
                )
                for w, ready in enumerate(readies)
            ]
            for proc in procs:
                proc.start()
            if not all(ready.wait(120) for ready in readies):
                raise RuntimeError("a worker process did not get ready")
            started = time.perf_counter()
            go.set()
            drained = sum(out.get(timeout=600) for _ in procs)
            drain_s = time.perf_counter() - started
            for proc in procs:
                proc.join(timeout=30)
        finally:
            server.stop()
        if drained != jobs:
            raise RuntimeError(f"workers completed {drained} of {jobs}")
        asyncio.run(_check_done(url, jobs))
    return enqueue_s, drain_s


# -- procrastinate ---------------------------------------------------------------------------------


def peer_python(given: str | None) -> str:
    """The interpreter of a virtualenv with procrastinate: `given`, or one created (once) in
    the temp dir."""
    if given:
        return given
    venv = Path(tempfile.gettempdir()) / "cv-bench-procrastinate"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", PEER_REQUIREMENT], check=True, timeout=600
        )
    return str(python)


def run_procrastinate(
    python: str, dsn: str, jobs: int, workers: int, concurrency: int
) -> tuple[float, float]:
    """(enqueue seconds, drain seconds) for procrastinate."""
    with fresh_schema(dsn) as schema:
        args = [dsn, schema, str(jobs), str(workers), str(concurrency)]
        done = subprocess.run(
            [python, "-m", "bench._procrastinate_peer", *args],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=Path(__file__).resolve().parent.parent,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"procrastinate run failed: {done.stderr[-2000:]}")
        report = json.loads(done.stdout.strip().splitlines()[-1])
    if report["succeeded"] != jobs:
        raise RuntimeError(f"procrastinate finished {report['succeeded']} of {jobs} jobs")
    return float(report["enqueue_s"]), float(report["drain_s"])


# -- DBOS ------------------------------------------------------------------------------------------


def dbos_python(given: str | None) -> str:
    """The interpreter of a virtualenv with DBOS: `given`, or one created (once) in the temp dir
    (the same one `bench.queue` uses)."""
    if given:
        return given
    venv = Path(tempfile.gettempdir()) / "cv-bench-dbos"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *DBOS_REQUIREMENTS], check=True, timeout=600
        )
    return str(python)


def run_dbos(
    python: str, dsn: str, jobs: int, workers: int, concurrency: int, poll_s: float
) -> tuple[float, float, dict[str, Any]]:
    """(enqueue seconds, drain seconds, rows per job per table) for DBOS."""
    with fresh_schema(dsn) as schema:
        args = [dsn, str(jobs), str(workers), str(concurrency), str(poll_s), schema]
        done = subprocess.run(
            [python, "-m", "bench._dbos_peer", *args],
            capture_output=True,
            text=True,
            timeout=1800,
            cwd=Path(__file__).resolve().parent.parent,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"DBOS run failed: {done.stderr[-2000:]}")
        report = json.loads(done.stdout.strip().splitlines()[-1])
    if report["succeeded"] != jobs:
        raise RuntimeError(f"DBOS finished {report['succeeded']} of {jobs} workflows")
    return jobs / float(report["enqueue_per_s"]), float(report["drain_s"]), report["rows_per_job"]


# -- pgqueuer, Oban, graphile-worker ---------------------------------------------------------------


def _venv(name: str, module: str, requirements: tuple[str, ...], base_python: str) -> str:
    """The interpreter of a throwaway virtualenv in the temp dir where `module` imports, made
    (again, if a earlier one is broken) from `base_python` with `requirements`."""
    venv = Path(tempfile.gettempdir()) / name
    python = venv / "bin" / "python"
    probe = [str(python), "-c", f"import {module}"]
    if python.exists() and subprocess.run(probe, capture_output=True, check=False).returncode == 0:
        return str(python)
    print(f"creating {venv} with {' '.join(requirements)} (benchmark only)", flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([base_python, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", *requirements], check=True, timeout=600
    )
    subprocess.run(probe, check=True, timeout=60)
    return str(python)


def pgqueuer_python() -> str:
    return _venv("cv-bench-pgqueuer", "pgqueuer", PGQUEUER_REQUIREMENTS, sys.executable)


def _python_312(given: str | None) -> str:
    """An interpreter of Python 3.12 or later: `given`, this one, the first `python3.13` /
    `python3.12` on PATH that really is one, or one that pyenv has installed (its shims run only
    the selected version, so each installed 3.12+ is asked for by `PYENV_VERSION`)."""
    if given:
        return given
    if sys.version_info >= (3, 12):
        return sys.executable
    candidates: list[tuple[str, dict[str, str]]] = [
        (name, {}) for name in ("python3.13", "python3.12") if shutil.which(name)
    ]
    if shutil.which("pyenv"):
        listed = subprocess.run(
            ["pyenv", "versions", "--bare"], capture_output=True, text=True, check=False
        ).stdout.split()
        candidates += [
            ("python3", {"PYENV_VERSION": v})
            for v in sorted(listed, reverse=True)
            if v.startswith(("3.12", "3.13", "3.14"))
        ]
    probe = "import sys; print(sys.version_info >= (3, 12), sys.executable)"
    for name, extra in candidates:
        done = subprocess.run(
            [name, "-c", probe],
            capture_output=True,
            text=True,
            env={**os.environ, **extra},
            check=False,
        )
        ok, _, executable = done.stdout.strip().partition(" ")
        if done.returncode == 0 and ok == "True":
            return executable
    raise RuntimeError("Oban needs Python >= 3.12: pass --oban-base-python")


def oban_python(base: str | None) -> str:
    """Oban's Python port needs Python 3.12 or later (see `_python_312`)."""
    return _venv("cv-bench-oban", "oban", (OBAN_REQUIREMENT,), _python_312(base))


def graphile_modules() -> str:
    """The node_modules of a throwaway npm prefix in the temp dir with graphile-worker."""
    prefix = Path(tempfile.gettempdir()) / "cv-bench-graphile"
    modules = prefix / "node_modules"
    if not (modules / "graphile-worker").exists():
        print(f"installing {GRAPHILE_REQUIREMENT} under {prefix} (benchmark only)", flush=True)
        subprocess.run(
            ["npm", "install", "--silent", "--prefix", str(prefix), GRAPHILE_REQUIREMENT],
            check=True,
            timeout=600,
        )
    return str(modules)


def peer_command(peer: str, oban_base: str | None) -> tuple[list[str], dict[str, str]]:
    """How to run a new peer's side module: (argv prefix, environment)."""
    if peer == "pgqueuer":
        return [pgqueuer_python(), "-m", "bench._pgqueuer_peer"], dict(os.environ)
    if peer == "oban":
        return [oban_python(oban_base), "-m", "bench._oban_peer"], dict(os.environ)
    if peer == "graphile-worker":
        env = {**os.environ, "NODE_PATH": graphile_modules()}
        return ["node", str(REPO / "bench" / "_graphile_peer.js")], env
    raise ValueError(peer)


def run_peer_side(command: tuple[list[str], dict[str, str]], mode: str, dsn: str,
                  args: list[str]) -> dict[str, Any]:  # fmt: skip
    """Run a peer's side module in `mode` on a fresh schema; its JSON report."""
    argv, env = command
    with fresh_schema(dsn) as schema, tempfile.TemporaryDirectory() as logdir:
        done = subprocess.run(
            [*argv, mode, dsn, schema, *args, logdir],
            capture_output=True,
            text=True,
            timeout=PEER_TIMEOUT_S,
            cwd=REPO,
            env=env,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"{argv[-1]} {mode} failed: {done.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def run_new_peer(
    command: tuple[list[str], dict[str, str]], dsn: str, jobs: int, workers: int, concurrency: int
) -> tuple[float, float, dict[str, Any]]:
    """(enqueue seconds, drain seconds, report) for pgqueuer, Oban or graphile-worker."""
    report = run_peer_side(command, "drain", dsn, [str(jobs), str(workers), str(concurrency)])
    if report["succeeded"] != jobs:
        raise RuntimeError(f"{report['system']} finished {report['succeeded']} of {jobs} jobs")
    return float(report["enqueue_s"]), float(report["drain_s"]), report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.pg_queue", description=__doc__)
    parser.add_argument("--database-url", required=True)
    parser.add_argument(
        "--quick", action="store_true", help="2,000 jobs, 1 worker, batches and concurrency 1,64"
    )
    parser.add_argument("--jobs", type=int, default=4000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--peer-concurrency", default="1,64")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated; '' for none")
    parser.add_argument("--procrastinate-python", default=None)
    parser.add_argument("--dbos-python", default=None)
    parser.add_argument("--dbos-poll", type=float, default=DEFAULT_DBOS_POLL_S)
    parser.add_argument(
        "--no-dbos", action="store_true", help="same as leaving dbos out of --peers"
    )
    parser.add_argument("--oban-base-python", default=None, help="a Python >= 3.12 for Oban's venv")
    parser.add_argument(
        "--ours-worker",
        default="sdk",
        help="comma-separated: sdk (cv-worker processes), raw (the bench's HTTP drainer)",
    )
    parser.add_argument(
        "--transport", default="channel", help="the sdk side's: channel, http, or both (comma)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.jobs, args.workers, args.batches, args.peer_concurrency = 2000, 1, "1,64", "1,64"
    dsn, jobs, workers = args.database_url, args.jobs, args.workers
    peers = [p for p in args.peers.split(",") if p and not (p == "dbos" and args.no_dbos)]
    unknown = set(peers) - set(PEERS)
    if unknown:
        parser.error(f"unknown peers {sorted(unknown)}; known: {', '.join(PEERS)}")
    sides = [w for w in args.ours_worker.split(",") if w]
    if set(sides) - {"sdk", "raw"}:
        parser.error(f"--ours-worker takes sdk and/or raw, not {args.ours_worker!r}")
    transports = [t for t in args.transport.split(",") if t]
    if not transports or set(transports) - {"channel", "http"}:
        parser.error(f"--transport takes channel and/or http, not {args.transport!r}")
    python = peer_python(args.procrastinate_python) if "procrastinate" in peers else None
    dbos = dbos_python(args.dbos_python) if "dbos" in peers else None
    commands = {
        p: peer_command(p, args.oban_base_python)
        for p in peers
        if p in ("pgqueuer", "oban", "graphile-worker")
    }
    concurrencies = [int(c) for c in args.peer_concurrency.split(",")]
    print(
        f"PostgreSQL synchronous_commit={pg_setting(dsn, 'synchronous_commit')}; {jobs} no-op"
        f" jobs, {workers} workers; load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    for _ in range(args.rounds):
        drains: dict[tuple[str, int], float] = {}
        persisted: dict[str, Any] = {}
        for concurrency in concurrencies:
            for peer in peers:
                if peer == "procrastinate":
                    assert python is not None
                    enq, drain = run_procrastinate(python, dsn, jobs, workers, concurrency)
                    note = ""
                elif peer == "dbos":
                    assert dbos is not None
                    enq, drain, rows = run_dbos(
                        dbos, dsn, jobs, workers, concurrency, args.dbos_poll
                    )
                    note = f"   (poll {args.dbos_poll} s)"
                    persisted[peer] = rows
                else:
                    enq, drain, report = run_new_peer(
                        commands[peer], dsn, jobs, workers, concurrency
                    )
                    note = f"   ({report['system']} {report['version']})"
                    persisted[peer] = report["rows_per_job"]
                drains[peer, concurrency] = drain
                print(
                    f"  {peer + ',':<16} concurrency {concurrency:<4}"
                    f"  enqueue {jobs / enq:7,.0f} jobs/s   drain {jobs / drain:7,.0f} jobs/s"
                    + note,
                    flush=True,
                )
        for peer, rows in persisted.items():
            print(f"  rows per job left after the drain, {peer}: {rows}", flush=True)
        if "sdk" in sides:
            for transport, concurrency in itertools.product(transports, concurrencies):
                sdk = run_sdk(dsn, jobs, workers, concurrency, transport, _enqueue)
                name = f"cv-worker {transport} x {concurrency}"
                print(
                    f"  {name:<29} enqueue {jobs / sdk.enqueue_s:7,.0f} jobs/s   drain"
                    f" {jobs / sdk.drain_s:7,.0f} jobs/s"
                    + _ratios(sdk.drain_s, drains, concurrency),
                    flush=True,
                )
                print(f"      wall {sdk.wall_s:.1f} s; {sdk.cpu()}", flush=True)
        if "raw" in sides:
            for batch in (int(b) for b in args.batches.split(",")):
                enqueue_s, drain_s = run_ours(dsn, jobs, workers, batch)
                name = f"cv-workspace, batch {batch}"
                print(
                    f"  {name:<29} enqueue {jobs / enqueue_s:7,.0f} jobs/s"
                    f"   drain {jobs / drain_s:7,.0f} jobs/s" + _ratios(drain_s, drains, batch),
                    flush=True,
                )
    print(f"load {os.getloadavg()[0]:.1f} at the end", flush=True)
    return 0


def _ratios(drain_s: float, drains: dict[tuple[str, int], float], concurrency: int) -> str:
    """Ours against the peers at the same concurrency (rates: the inverse of the drain times)."""
    same = {p: d for (p, c), d in drains.items() if c == concurrency}
    if same:
        best = min(same, key=lambda p: same[p])
        return (
            f"   {same[best] / drain_s:5.2f}x the best peer at concurrency {concurrency}"
            f" ({best});" + ", ".join(f" {p} {same[p] / drain_s:.2f}x" for p in same)
        )
    if drains:
        return f"   {min(drains.values()) / drain_s:5.2f}x the best peer drain"
    return ""


if __name__ == "__main__":
    raise SystemExit(main())
