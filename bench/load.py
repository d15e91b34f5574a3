"""1,000 live websocket clients against one server: `python -m bench.load`.

Each client opens the workspace websocket, subscribes to one sub-doc (`--docs` of them, so each
op is broadcast to `clients / docs` subscribers) and applies one `node.insert` every
`1 / --rate` seconds (steady, each client at its own phase) for `--seconds`. The clients are
split over `--drivers` processes speaking the websocket protocol directly (the load, not a
driver's CPU, must be what is measured). Reported per case:

- errors: connections lost, error frames, rejected ops, acks missing at the end, and ops a
  subscriber never received (every subscriber must get every op of its sub-doc): must be 0;
- ack latency (apply sent → its ack) and broadcast latency (apply sent → the op frame at each
  subscriber), p50 / p99 / max;
- the server's peak RSS and CPU (cores busy over the load window), and the machine's load.

Cases: SQLite (one `cv-server`), and PostgreSQL with two instances on one database (clients
alternate between them, so most broadcasts cross instances) when `--database-url` or
`$CV_TEST_DATABASE_URL` is set. The fd limit is raised first (`raise_nofile`): the server
inherits it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp

from bench._procs import MachineLoad, ServerProcess, percentiles, raise_nofile
from bench.pg_instances import fresh_schema, with_schema

__all__ = ["main"]

WS: Final = "load"
#: How long the clients may take to connect and catch up before the load window opens.
CONNECT_S: Final = 120.0
#: How long, after the window, acks and broadcasts may take to arrive before they count as lost.
DRAIN_S: Final = 60.0


# -- a driver process: a share of the clients ---------------------------------------------------


@dataclass
class _Client:
    index: int
    doc: str
    url: str
    sent: dict[int, float]
    acked: int = 0
    received: int = 0
    #: The window is over (no more sends).
    finished: bool = False
    #: Set once the window is over and every op sent was acknowledged.
    acks_in: asyncio.Event | None = None

    def check_acks(self) -> None:
        if self.finished and not self.sent and self.acks_in is not None:
            self.acks_in.set()


async def _client(
    c: _Client,
    session: aiohttp.ClientSession,
    token: str,
    start_at: float,
    end_at: float,
    rate: float,
    out: dict[str, Any],
    connected: asyncio.Event,
    counts: dict[str, int],
    totals: asyncio.Future[dict[str, int]],
) -> None:
    errors: Counter[str] = out["errors"]
    url = f"{c.url}/v1/workspaces/{WS}/socket"
    try:
        async with session.ws_connect(url, headers={"Authorization": f"Bearer {token}"}) as ws:
            await ws.send_json({"type": "subscribe", "sub_doc": c.doc, "since": 0})
            synced = asyncio.Event()
            done = asyncio.Event()

            async def read() -> None:
                async for msg in ws:
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        break
                    now = time.monotonic()
                    frame = json.loads(msg.data)
                    kind = frame.get("type")
                    if kind == "synced":
                        synced.set()
                    elif kind == "op":
                        c.received += 1
                        sent_at = frame["op"].get("fields", {}).get("t")
                        if isinstance(sent_at, float):
                            out["broadcast"].append(now - sent_at)
                    elif kind == "ack":
                        t0 = c.sent.pop(frame["req"], None)
                        if t0 is not None:
                            out["ack"].append(now - t0)
                            c.acked += 1
                            counts[c.doc] = counts.get(c.doc, 0) + 1
                            c.check_acks()
                        for result in frame.get("results", []):
                            if result.get("error") is not None or result.get("code"):
                                errors[f"rejected:{result.get('code')}"] += 1
                    elif kind == "error":
                        errors[f"error_frame:{frame.get('code')}"] += 1
                    if totals.done() and c.received >= totals.result().get(c.doc, 0) and not c.sent:
                        done.set()
                if not done.is_set():
                    errors["connection_lost"] += 1
                done.set()

            reader = asyncio.create_task(read())
            await asyncio.wait_for(synced.wait(), CONNECT_S)
            connected.set()
            await asyncio.sleep(max(0.0, start_at - time.monotonic()))
            gap = 1.0 / rate
            next_at = start_at + random.random() * gap  # each client at its own phase
            n = 0
            while (now := time.monotonic()) < end_at:
                if next_at > now:
                    await asyncio.sleep(next_at - now)  # the load's pace
                    continue
                n += 1
                stamp = time.monotonic()
                c.sent[n] = stamp
                op = {"type": "node.insert", "node_id": f"c{c.index}-{n}", "parent_id": "root",
                      "fields": {"t": stamp}, "op_id": f"L{c.index:05d}-{n:06d}"}  # fmt: skip
                await ws.send_json({"type": "apply", "sub_doc": c.doc, "req": n, "ops": [op]})
                next_at += gap
            c.finished = True
            c.check_acks()
            final = await totals
            if c.received >= final.get(c.doc, 0) and not c.sent:
                done.set()
            try:
                await asyncio.wait_for(done.wait(), DRAIN_S)
            except TimeoutError:
                errors["acks_missing"] += len(c.sent)
                errors["broadcasts_missing"] += max(0, final.get(c.doc, 0) - c.received)
            reader.cancel()
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        errors[f"connect:{type(exc).__name__}"] += 1
        connected.set()


async def _drive(spec: dict[str, Any]) -> None:
    """One driver: connect its clients, report "connected", run the window, report its acked
    ops per sub-doc, read back the totals over every driver, wait for them, report latencies."""
    out: dict[str, Any] = {"ack": [], "broadcast": [], "errors": Counter()}
    counts: dict[str, int] = {}
    totals: asyncio.Future[dict[str, int]] = asyncio.get_running_loop().create_future()
    clients = [
        _Client(i, f"d{i % spec['docs']}", spec["urls"][i % len(spec["urls"])], {})
        for i in range(spec["first"], spec["last"])
    ]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        events = [asyncio.Event() for _ in clients]
        for c in clients:
            c.acks_in = asyncio.Event()
        start_at, end_at = spec["start_at"], spec["start_at"] + spec["seconds"]
        token, rate = spec["token"], spec["rate"]
        tasks = [
            asyncio.create_task(
                _client(c, session, token, start_at, end_at, rate, out, e, counts, totals)
            )
            for c, e in zip(clients, events, strict=True)
        ]
        for event in events:
            await event.wait()
        print(json.dumps({"connected": len(clients)}), flush=True)
        await asyncio.sleep(max(0.0, end_at - time.monotonic()))
        # Acks still due arrive within DRAIN_S; count what was acknowledged by then.
        with contextlib.suppress(TimeoutError):
            waits = [c.acks_in.wait() for c in clients if c.acks_in is not None]
            await asyncio.wait_for(asyncio.gather(*waits), DRAIN_S)
        print(json.dumps({"acked": counts}), flush=True)
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        totals.set_result(json.loads(line)["totals"])
        await asyncio.gather(*tasks)
    print(json.dumps({"ack": out["ack"], "broadcast": out["broadcast"],
                      "errors": dict(out["errors"])}), flush=True)  # fmt: skip


# -- the parent ---------------------------------------------------------------------------------


@dataclass
class CaseResult:
    name: str
    clients: int
    seconds: float
    ops: int
    errors: dict[str, int]
    ack: dict[str, float]
    broadcast: dict[str, float]
    broadcasts: int
    peak_rss_mib: float
    server_cores: float
    machine_cores: float
    cpu_stall: float | None

    def lines(self) -> list[str]:
        def ms(p: dict[str, float]) -> str:
            return " / ".join(f"{p[k] * 1000:.1f}" for k in ("p50", "p99", "max"))

        stall = "n/a" if self.cpu_stall is None else f"{self.cpu_stall:.0%}"
        return [
            f"{self.name}: {self.clients} clients x {self.seconds:g} s: {self.ops} ops"
            f" ({self.ops / self.seconds:.0f}/s), {self.broadcasts} broadcasts,"
            f" errors={sum(self.errors.values())} {self.errors or ''}".rstrip(),
            f"  ack ms p50/p99/max: {ms(self.ack)}",
            f"  broadcast ms p50/p99/max: {ms(self.broadcast)}",
            f"  server: peak RSS {self.peak_rss_mib:.0f} MiB, CPU {self.server_cores:.2f} cores;"
            f" machine busy {self.machine_cores:.2f} of {os.cpu_count()} cores,"
            f" CPU stall {stall}",
        ]


async def _run_case(
    name: str, servers: list[ServerProcess], args: argparse.Namespace
) -> CaseResult:
    urls = [s.url for s in servers]
    token = servers[0].token
    per = -(-args.clients // args.drivers)
    start_at = time.monotonic() + CONNECT_S  # replaced below once everyone is connected
    drivers = []
    for d in range(args.drivers):
        first, last = d * per, min(args.clients, (d + 1) * per)
        if first >= last:
            continue
        spec = {"urls": urls, "token": token, "first": first, "last": last, "docs": args.docs,
                "rate": args.rate, "seconds": args.seconds, "start_at": 0.0}  # fmt: skip
        drivers.append(spec)
    # The window opens once every driver connected: each driver learns the moment up front, so
    # it is set far enough ahead for the connects (bounded by CONNECT_S).
    start_at = time.monotonic() + args.connect_seconds
    procs = []
    for spec in drivers:
        spec["start_at"] = start_at
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.load", "--driver", json.dumps(spec),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=1 << 28,
        )  # fmt: skip
        procs.append(proc)

    async def message(proc: asyncio.subprocess.Process) -> dict[str, Any]:
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        if not line:
            raise RuntimeError("a load driver exited early")
        decoded: dict[str, Any] = json.loads(line)
        return decoded

    connected = await asyncio.gather(*(message(p) for p in procs))
    if time.monotonic() > start_at:
        raise RuntimeError(f"clients took longer than --connect-seconds to connect: {connected}")
    for s in servers:
        s.reset_peak()
    cpu0 = [sum(s.cpu_seconds()) for s in servers]
    load0 = MachineLoad.now()
    await asyncio.sleep(max(0.0, start_at + args.seconds - time.monotonic()))
    cpu1 = [sum(s.cpu_seconds()) for s in servers]
    load1 = MachineLoad.now()
    peak = sum(s.peak_rss() for s in servers)
    acked = await asyncio.gather(*(message(p) for p in procs))
    totals: Counter[str] = Counter()
    for a in acked:
        totals.update(a["acked"])
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write((json.dumps({"totals": dict(totals)}) + "\n").encode())
        await proc.stdin.drain()
    results = await asyncio.gather(*(message(p) for p in procs))
    for proc in procs:
        await proc.wait()
    errors: Counter[str] = Counter()
    acks: list[float] = []
    broadcasts: list[float] = []
    for r in results:
        errors.update(r["errors"])
        acks += r["ack"]
        broadcasts += r["broadcast"]
    busy, stall = load1.since(load0)
    return CaseResult(
        name=name,
        clients=args.clients,
        seconds=args.seconds,
        ops=sum(totals.values()),
        errors=dict(errors),
        ack=percentiles(acks),
        broadcast=percentiles(broadcasts),
        broadcasts=len(broadcasts),
        peak_rss_mib=peak / 2**20,
        server_cores=sum(b - a for a, b in zip(cpu0, cpu1, strict=True)) / args.seconds,
        machine_cores=busy,
        cpu_stall=stall,
    )


async def _sqlite(args: argparse.Namespace, work: Path) -> CaseResult:
    server = await asyncio.to_thread(ServerProcess.start, work / "load.db")
    try:
        return await _run_case("sqlite, 1 instance", [server], args)
    finally:
        await asyncio.to_thread(server.stop)


async def _postgres(args: argparse.Namespace, work: Path, url: str) -> CaseResult:
    servers: list[ServerProcess] = []
    try:
        for _ in range(2):
            start = ServerProcess.start
            servers.append(await asyncio.to_thread(start, work / "unused.db", database_url=url))
        return await _run_case("postgres, 2 instances", servers, args)
    finally:
        for server in servers:
            await asyncio.to_thread(server.stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.load", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the load window")
    parser.add_argument("--rate", type=float, default=0.2, help="ops per second per client")
    parser.add_argument("--docs", type=int, default=100, help="sub-docs (clients share them)")
    parser.add_argument("--drivers", type=int, default=4, help="client processes")
    parser.add_argument("--connect-seconds", type=float, default=45.0,
                        help="time the clients get to connect before the window opens")  # fmt: skip
    parser.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--database-url", default=os.environ.get("CV_TEST_DATABASE_URL"))
    parser.add_argument("--driver", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.driver is not None:
        asyncio.run(_drive(json.loads(args.driver)))
        return 0
    nofile = raise_nofile()
    print(f"fd limit {nofile}; {args.clients} clients, {args.rate:g} ops/s each,"
          f" {args.docs} sub-docs, {args.drivers} driver processes", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="cv-load-") as tmp:
        results = []
        if args.backend in ("sqlite", "both"):
            results.append(asyncio.run(_sqlite(args, Path(tmp))))
            print("\n".join(results[-1].lines()), flush=True)
        if args.backend in ("postgres", "both"):
            if not args.database_url:
                print("postgres: skipped (no --database-url / $CV_TEST_DATABASE_URL)")
            else:
                with fresh_schema(args.database_url) as schema:
                    url = with_schema(args.database_url, schema)
                    results.append(asyncio.run(_postgres(args, Path(tmp), url)))
                print("\n".join(results[-1].lines()), flush=True)
        failed = any(r.errors for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
