"""Committed ops/s through 1 and 2 `cv-server` instances sharing one PostgreSQL database (issue 7).

    python -m bench.pg_instances --database-url postgresql://postgres@127.0.0.1:5432/test
                                 [--writers 64] [--sub-docs 16] [--seconds 10] [--rounds 1]
                                 [--instances 1,2] [--clients 4]

Each case gets a fresh schema (dropped afterwards) and fresh server processes; PostgreSQL runs as
configured (`synchronous_commit` is printed: `on` means an acknowledged op is on disk). 64
single-op writers (one op per HTTP request, each awaiting its answer before the next) are spread
over the instances (writer i talks to instance i mod n) and over `--sub-docs` sub-docs of one
workspace; each op is a `node.increment` with its own op_id. The writers are bare HTTP/1.1
keep-alive clients in `--clients` processes, to leave the cores to the servers and PostgreSQL.

After the run every sub-doc's head must equal the number of ops acknowledged on it (gap-free,
nothing lost, nothing twice), or the figure is not printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final

import asyncpg  # type: ignore[import-untyped]
import psutil  # type: ignore[import-untyped]

WORKSPACE: Final = "bench"
START_TIMEOUT_S: Final = 60.0
#: Warm-up before the measured window: every connection open, every sub-doc's lane cached.
WARMUP_S: Final = 2.0


# -- PostgreSQL and server processes ---------------------------------------------------------------


#: The PostgreSQL server benchmarks use when not told another (the tests' default).
DEFAULT_DSN: Final = os.environ.get(
    "CV_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test"
)


def execute(dsn: str, sql: str) -> None:
    """Run `sql` (any number of statements) on a connection of its own to `dsn`."""

    async def run() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run())


def with_schema(dsn: str, schema: str) -> str:
    sep = "&" if "?" in dsn else "?"
    return f"{dsn}{sep}search_path={schema}"


@contextmanager
def fresh_schema(dsn: str) -> Iterator[str]:
    name = f"bench_{secrets.token_hex(5)}"
    execute(dsn, f"CREATE SCHEMA {name}")
    try:
        yield name
    finally:
        execute(dsn, f"DROP SCHEMA IF EXISTS {name} CASCADE")


def pg_setting(dsn: str, name: str) -> str:
    async def read() -> str:
        conn = await asyncpg.connect(dsn)
        try:
            return str(await conn.fetchval(f"SHOW {name}"))
        finally:
            await conn.close()

    return asyncio.run(read())


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "cv_server.cli", *args]


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str

    @classmethod
    def start(cls, database_url: str) -> Server:
        proc = subprocess.Popen(
            cli("serve", "--database-url", database_url, "--port", "0", "--log-level", "WARNING"),
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the server says where it listens
        if "listening on" not in line:
            proc.kill()
            raise RuntimeError(f"cv-server did not start: {line!r}")
        return cls(proc, line.rsplit(" ", 1)[1].strip())

    def cpu_seconds(self) -> float:
        times = psutil.Process(self.proc.pid).cpu_times()
        return float(times.user + times.system)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def postgres_cpu_seconds() -> float:
    """CPU seconds of every PostgreSQL backend process on this machine (all users)."""
    total = 0.0
    for proc in psutil.process_iter(["name", "cpu_times"]):
        if proc.info["name"] and proc.info["name"].startswith("postgres"):
            times = proc.info["cpu_times"]
            if times is not None:
                total += times.user + times.system
    return total


# -- writer processes ------------------------------------------------------------------------------


@dataclass
class WriterResult:
    acked: dict[str, int] = field(default_factory=dict)
    #: Every acknowledged op, warm-up included (what the heads must add up to).
    all_acked: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    cpu_s: float = 0.0


class RawPoster:
    """HTTP/1.1 keep-alive POSTs on one connection, parsing only a Content-Length answer."""

    def __init__(self, url: str, token: str) -> None:
        hostport = url.removeprefix("http://")
        host, _, port = hostport.rpartition(":")
        self.host, self.port = host, int(port)
        self.head = (
            f"Host: {hostport}\r\nAuthorization: Bearer {token}\r\n"
            "Content-Type: application/json\r\n"
        )
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, Any]:
        if self.reader is None or self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        request = f"POST {path} HTTP/1.1\r\n{self.head}Content-Length: {len(body)}\r\n\r\n"
        self.writer.write(request.encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        payload = await self.reader.readexactly(length)
        return int(lines[0].split(" ", 2)[1]), json.loads(payload) if payload else None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _writers(
    targets: list[tuple[str, str]], token: str, seconds: float, go_at: float
) -> WriterResult:
    result = WriterResult()
    prefix = secrets.token_urlsafe(9)
    counter = 0

    async def writer(url: str, sub_doc: str) -> None:
        nonlocal counter
        poster = RawPoster(url, token)
        path = f"/v1/workspaces/{WORKSPACE}/docs/{sub_doc}/ops"
        end = go_at + seconds
        try:
            while (now := time.time()) < end:
                counter += 1
                op = {"type": "node.increment", "node_id": "root", "field": "n", "by": 1}
                op["op_id"] = f"{prefix}{counter:x}"
                body = json.dumps({"ops": [op]}, separators=(",", ":")).encode()
                began = time.perf_counter()
                status, answer = await poster.post(path, body)
                if status != 200 or "clock" not in answer["results"][0]:
                    result.errors.append(f"{status} {str(answer)[:200]}")
                    continue
                result.all_acked[sub_doc] = result.all_acked.get(sub_doc, 0) + 1
                if now >= go_at:  # acknowledged inside the measured window
                    result.acked[sub_doc] = result.acked.get(sub_doc, 0) + 1
                    result.latencies_ms.append((time.perf_counter() - began) * 1000)
        finally:
            poster.close()

    cpu0 = time.process_time()
    await asyncio.gather(*(writer(url, sub_doc) for url, sub_doc in targets))
    result.cpu_s = time.process_time() - cpu0
    return result


def writer_process(
    targets: list[tuple[str, str]], token: str, seconds: float, go_at: float, out: Any
) -> None:
    out.put(asyncio.run(_writers(targets, token, seconds, go_at)))


# -- one case --------------------------------------------------------------------------------------


@dataclass
class CaseResult:
    instances: int
    ops: int
    seconds: float
    p50_ms: float
    p99_ms: float
    server_cpu: float
    postgres_cpu: float
    client_cpu: float
    machine_busy: float
    errors: list[str]

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds


def heads(database_url: str, sub_docs: list[str]) -> dict[str, int]:
    async def read() -> dict[str, int]:
        conn = await asyncpg.connect(database_url)
        try:
            rows = await conn.fetch(
                "SELECT sub_doc, clock FROM workspace_sub_doc_heads WHERE workspace_id = $1",
                WORKSPACE,
            )
        finally:
            await conn.close()
        return {row["sub_doc"]: int(row["clock"]) for row in rows if row["sub_doc"] in sub_docs}

    return asyncio.run(read())


def run_case(dsn: str, instances: int, args: argparse.Namespace) -> CaseResult:
    with fresh_schema(dsn) as schema:
        url = with_schema(dsn, schema)
        subprocess.run(cli("init", "--database-url", url), check=True, timeout=60)
        token = subprocess.run(
            cli("token", "--database-url", url, "--workspace", WORKSPACE),
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
        servers = [Server.start(url) for _ in range(instances)]
        try:
            sub_docs = [f"doc-{i}" for i in range(args.sub_docs)]
            targets = [
                (servers[i % instances].url, sub_docs[i % len(sub_docs)])
                for i in range(args.writers)
            ]
            ctx = multiprocessing.get_context("spawn")
            out = ctx.Queue()
            # Processes start first; the window opens after the warm-up, for all at once.
            go_at = time.time() + WARMUP_S + 2.0
            procs = [
                ctx.Process(
                    target=writer_process,
                    args=(targets[c :: args.clients], token, args.seconds, go_at, out),
                )
                for c in range(args.clients)
            ]
            for proc in procs:
                proc.start()
            # Count the warm-up writes too: the head check below covers every op.
            time.sleep(max(0.0, go_at - time.time()))
            server_cpu0 = sum(s.cpu_seconds() for s in servers)
            pg_cpu0 = postgres_cpu_seconds()
            busy0 = psutil.cpu_times()
            results: list[WriterResult] = [out.get(timeout=args.seconds + 120) for _ in procs]
            busy1 = psutil.cpu_times()
            server_cpu = sum(s.cpu_seconds() for s in servers) - server_cpu0
            pg_cpu = postgres_cpu_seconds() - pg_cpu0
            for proc in procs:
                proc.join(timeout=30)
        finally:
            for server in servers:
                server.stop()
        acked: dict[str, int] = {}
        all_acked: dict[str, int] = {}
        latencies: list[float] = []
        errors: list[str] = []
        for result in results:
            for sub_doc, n in result.acked.items():
                acked[sub_doc] = acked.get(sub_doc, 0) + n
            for sub_doc, n in result.all_acked.items():
                all_acked[sub_doc] = all_acked.get(sub_doc, 0) + n
            latencies += result.latencies_ms
            errors += result.errors
        committed = heads(url, sub_docs)
        total = sum(acked.values())
        # Gap-free, nothing lost, nothing twice: each head is exactly its acknowledged ops.
        if committed != {d: n for d, n in all_acked.items() if n}:
            errors.append(f"heads {committed} != acknowledged {all_acked}")
        latencies.sort()
        idle = (busy1.idle - busy0.idle) + getattr(busy1, "iowait", 0) - getattr(busy0, "iowait", 0)
        wall = sum(busy1) - sum(busy0)
        return CaseResult(
            instances=instances,
            ops=total,
            seconds=args.seconds,
            p50_ms=statistics.median(latencies) if latencies else 0.0,
            p99_ms=latencies[int(len(latencies) * 0.99)] if latencies else 0.0,
            server_cpu=server_cpu / args.seconds,
            postgres_cpu=pg_cpu / args.seconds,
            client_cpu=sum(r.cpu_s for r in results) / args.seconds,
            machine_busy=(wall - idle) / wall * (os.cpu_count() or 1) if wall else 0.0,
            errors=errors,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.pg_instances", description=__doc__)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--writers", type=int, default=64)
    parser.add_argument("--sub-docs", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--instances", default="1,2")
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args(argv)
    commit = pg_setting(args.database_url, "synchronous_commit")
    fsync = pg_setting(args.database_url, "fsync")
    print(
        f"PostgreSQL synchronous_commit={commit} fsync={fsync}; {args.writers} single-op writers,"
        f" {args.sub_docs} sub-docs, {args.seconds:g} s per case, load {os.getloadavg()[0]:.1f}"
    )
    for _ in range(args.rounds):
        for instances in (int(n) for n in args.instances.split(",")):
            case = run_case(args.database_url, instances, args)
            status = "OK" if not case.errors else f"ERRORS: {case.errors[:3]}"
            print(
                f"{instances} instance(s): {case.ops_per_s:8,.0f} ops/s committed"
                f"  p50 {case.p50_ms:5.1f} ms  p99 {case.p99_ms:6.1f} ms"
                f"  cores: servers {case.server_cpu:.2f}, postgres {case.postgres_cpu:.2f},"
                f" clients {case.client_cpu:.2f}, machine {case.machine_busy:.2f}  {status}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
