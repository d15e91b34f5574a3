"""Run the ShareDB peer benchmark (`peers/sharedb-bench.js` in the shared folder beside the
repository) with a given workload and read its figures back.

The peer is ShareDB 7, installed once with

    npm install --prefix /tmp/peer-sharedb sharedb@7 ws@8 sharedb-postgres@5

with its in-memory database (`db="memory"`: not durable, the issue's yardstick) or with
sharedb-postgres (`db="pg"`: each op committed to PostgreSQL before its ack, the peer's own durable
setup). For the latter every run gets a scratch database of its own (`scratch_peer_database`),
created from the peer's `structure.sql` and dropped afterwards, so no run sees another's ops.

`PEER_MODULES` (environment) overrides where its node_modules live.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

import psutil  # type: ignore[import-untyped]  # no types-psutil in the dev extras

from bench.pg_instances import execute

__all__ = ["PeerFigures", "find_peer", "run_peer", "scratch_peer_database"]

#: Where the peer README installs ShareDB.
DEFAULT_MODULES: Final = Path("/tmp/peer-sharedb/node_modules")
#: One peer run may take this long before it is abandoned.
PEER_TIMEOUT_S: Final = 180.0

_OPS_RE: Final = re.compile(r"committed \(acked\) ops: (\d+) in ([\d.]+)s => (\d+) ops/s")
_LAT_RE: Final = re.compile(r"n=(\d+) p50=([\d.]+|NaN)ms p95=([\d.]+|NaN)ms p99=([\d.]+|NaN)ms")
_SAW_RE: Final = re.compile(r"all subscribers saw all ops: (true|false)")
_VERSION_RE: Final = re.compile(r"^ShareDB (\S+)")


@dataclass(slots=True)
class PeerFigures:
    ops: int = 0
    ops_per_s: float = 0.0
    ack_ms: dict[str, float] = field(default_factory=dict)
    broadcast_ms: dict[str, float] = field(default_factory=dict)
    all_seen: bool | None = None
    version: str = ""
    error: str = ""
    #: CPU seconds of the whole peer run (client and server processes, start-up included).
    cpu_s: float = 0.0
    #: CPU seconds of the same run with no ops (start-up, connects, shutdown).
    idle_cpu_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Peer:
    node: str
    script: Path
    modules: Path


def find_peer(repo_root: Path) -> Peer | str:
    """The node binary, the peer script and ShareDB's install, or why the peer cannot run."""
    node = shutil.which("node")
    if node is None:
        return "node is not installed"
    script = repo_root.parent / "shared" / "peers" / "sharedb-bench.js"
    if not script.exists():
        return "the peer script (shared/peers/sharedb-bench.js beside the repository) is missing"
    modules = Path(os.environ.get("PEER_MODULES", str(DEFAULT_MODULES)))
    if not (modules / "sharedb").is_dir() or not (modules / "ws").is_dir():
        return (
            f"ShareDB is not installed in {modules} (npm install --prefix /tmp/peer-sharedb"
            " sharedb@7 ws@8 sharedb-postgres@5)"
        )
    return Peer(node, script, modules)


def _latency(line: str) -> dict[str, float]:
    match = _LAT_RE.search(line)
    if match is None or "NaN" in match.groups():
        return {}
    n, p50, p95, p99 = (float(x) for x in match.groups())
    return {"p50": p50, "p95": p95, "p99": p99, "n": n}


@contextmanager
def scratch_peer_database(peer: Peer, admin_dsn: str) -> Iterator[dict[str, str]]:
    """A fresh PostgreSQL database holding sharedb-postgres's tables, dropped on exit; yields the
    `PG*` environment that points the peer at it. `admin_dsn`: any database of the server, from
    which the scratch one is created."""
    structure = peer.modules / "sharedb-postgres" / "structure.sql"
    if not structure.exists():
        raise FileNotFoundError(f"{structure} is missing (npm install ... sharedb-postgres@5)")
    name = f"cv_peer_sharedb_{secrets.token_hex(4)}"
    parts = urlsplit(admin_dsn)
    scratch_dsn = parts._replace(path=f"/{name}", query="").geturl()

    execute(admin_dsn, f"CREATE DATABASE {name}")
    try:
        execute(scratch_dsn, structure.read_text())
        yield {
            "PGHOST": parts.hostname or "127.0.0.1",
            "PGPORT": str(parts.port or 5432),
            "PGUSER": parts.username or "postgres",
            "PGDATABASE": name,
        }
    finally:
        execute(admin_dsn, f"DROP DATABASE IF EXISTS {name}")


def run_peer(
    peer: Peer,
    *,
    ops: int,
    writers: int,
    subs: int,
    docs: int,
    db: str = "memory",
    env: dict[str, str] | None = None,
) -> PeerFigures:
    """One run of the peer benchmark with this workload: `db` "memory" (the default) or "pg"
    (with `env` from `scratch_peer_database`)."""
    figures = PeerFigures()
    command = [
        peer.node,
        str(peer.script),
        "--ops",
        str(ops),
        "--writers",
        str(writers),
        "--subs",
        str(subs),
        "--docs",
        str(docs),
        "--db",
        db,
    ]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, NODE_PATH=str(peer.modules), **(env or {})),
    )
    sampler = _CpuSampler(proc.pid)
    try:
        stdout, stderr = proc.communicate(timeout=PEER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        figures.error = f"timed out after {PEER_TIMEOUT_S:.0f} s"
        return figures
    finally:
        sampler.stop()
    figures.cpu_s = sampler.total()
    for line in stdout.splitlines():
        if (match := _VERSION_RE.match(line)) is not None:
            figures.version = match.group(1)
        elif (match := _OPS_RE.search(line)) is not None:
            figures.ops = int(match.group(1))
            figures.ops_per_s = float(match.group(3))
        elif line.startswith("ack latency"):
            figures.ack_ms = _latency(line)
        elif line.startswith("broadcast latency"):
            figures.broadcast_ms = _latency(line)
        elif (match := _SAW_RE.search(line)) is not None:
            figures.all_seen = match.group(1) == "true"
    if proc.returncode != 0 or not figures.ops:
        tail = (stderr or stdout).strip().splitlines()[-3:]
        figures.error = f"exit {proc.returncode}: {' | '.join(tail)}"
    return figures


class _CpuSampler:
    """CPU seconds of the peer's process tree (its client process and the server it forks),
    sampled every 50 ms: the server child is not reaped by us, so rusage would miss it."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-cpu", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(0.05):
                return

    def _sample(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        for proc in procs:
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            self.seen[proc.pid] = times.user + times.system

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def total(self) -> float:
        return sum(self.seen.values())
