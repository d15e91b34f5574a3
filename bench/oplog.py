"""End-to-end op-log benchmark against the real `cv-server` process (issue 3).

    python -m bench.oplog [--quick] [--scenario a|b|c|d|all] [--database-url URL]
                          [--writers aiohttp|raw|socket] [--profile DIR] [--json PATH]

Each scenario starts a fresh server on a fresh database file (SQLite, `synchronous=FULL`: an
acknowledged op is on disk) and drives it from client processes (aiohttp, many connections per
process). Scenarios:

- a: 64 concurrent single-op writers (HTTP POST by default), each awaiting its ack before its
  next op.
- b: 8 concurrent writers posting batches of 100 ops.
- c: 100 websocket subscribers on one sub-doc while paced writers commit to it; every subscriber
  must see every acknowledged op exactly once, in clock order.
- d: 10,000 idle websocket subscribers (100 sub-docs x 100), then a few paced ops; server RSS
  before and after connecting, and the same exactly-once check.

Ops are `node.increment` on the root (cheap to apply, and a double apply would show), with a
fresh op_id each and the send time in `meta.t` for broadcast latency. Figures go to
bench/README.md with the command that produced them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pstats
import queue
import secrets
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from bench._digest import digest_of
from bench._oplog_clients import (
    Control,
    SubscriberResult,
    SubscriberSpec,
    Target,
    Transport,
    WorkerFailed,
    WriterResult,
    WriterSpec,
    worker_main,
)
from bench._procs import (
    MachineLoad,
    ServerProcess,
    ServerRefused,
    fsync_probe_ms,
    percentiles,
    raise_nofile,
)

#: One workspace per run: a PostgreSQL database outlives the run, and every check below expects
#: the sub-docs to start at clock 0.
WORKSPACE: Final = f"bench-{secrets.token_hex(4)}"
WRITERS: Final = {
    "aiohttp": "HTTP POST (aiohttp client)",
    "raw": "HTTP POST (bare HTTP/1.1 client)",
    "socket": "websocket apply",
}
MIB: Final = 1024 * 1024
#: How long the parent waits for client processes to get ready (10,000 sockets take a while).
READY_TIMEOUT_S: Final = 240.0
#: Slack on top of a scenario's duration for its results to come back.
RESULT_SLACK_S: Final = 120.0


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    writer_procs: int
    writers: int
    batch: int
    write_docs: tuple[str, ...]
    duration_s: float
    #: Ops per second per writer (open-loop pacing); None = closed loop, flat out.
    rate: float | None = None
    max_requests: int = 10_000_000
    subscriber_procs: int = 0
    subscribers: int = 0
    #: True: every subscriber watches every written sub-doc; False: round-robin, one each.
    each_all: bool = True
    #: What subscribers watch when not the written sub-docs (a control experiment: idle
    #: connections that receive nothing).
    watch_docs: tuple[str, ...] | None = None
    target: str = ""


def _docs(prefix: str, count: int) -> tuple[str, ...]:
    width = len(str(count - 1))
    return tuple(f"{prefix}-{i:0{width}d}" for i in range(count))


def scenarios(quick: bool) -> dict[str, Scenario]:
    """The four scenarios of issue 3; `quick` shortens durations, never the connection counts."""
    run_s = 5.0 if quick else 20.0
    return {
        "a": Scenario(
            "a",
            "64 concurrent single-op writers (16 sub-docs x 4 writers)",
            writer_procs=2,
            writers=64,
            batch=1,
            write_docs=_docs("a", 16),
            duration_s=run_s,
            target="committed >= 5,000 ops/s (durable)",
        ),
        "b": Scenario(
            "b",
            "batches of 100 ops (8 concurrent writers, one sub-doc each)",
            writer_procs=2,
            writers=8,
            batch=100,
            write_docs=_docs("b", 8),
            duration_s=run_s,
            target="committed >= 50,000 ops/s",
        ),
        "c": Scenario(
            "c",
            "100 websocket subscribers on 1 sub-doc, 8 paced writers (200 ops/s total)",
            writer_procs=1,
            writers=8,
            batch=1,
            write_docs=("c-0",),
            duration_s=run_s,
            rate=25.0,
            subscriber_procs=2,
            subscribers=100,
            each_all=True,
            target="broadcast p99 <= 20 ms, every op exactly once in order",
        ),
        "d": Scenario(
            "d",
            "10,000 idle subscribers (100 sub-docs x 100), then 2 ops on each sub-doc over 4 s",
            writer_procs=1,
            writers=100,
            batch=1,
            write_docs=_docs("d", 100),
            duration_s=4.0,
            rate=0.5,
            max_requests=2,
            subscriber_procs=4,
            subscribers=10_000,
            each_all=False,
            target="server RSS <= 1 GiB, every op exactly once in order",
        ),
    }


@dataclass
class Report:
    key: str
    title: str
    target: str
    duration_s: float = 0.0
    ops: int = 0
    requests: int = 0
    ops_per_s: float = 0.0
    ack_ms: dict[str, float] = field(default_factory=dict)
    broadcast_ms: dict[str, float] = field(default_factory=dict)
    frames: int = 0
    rss_idle_mib: float = 0.0
    rss_connected_mib: float = 0.0
    rss_peak_mib: float = 0.0
    connect_s: float = 0.0
    #: CPU seconds over the writing window (from `go` to the last writer's result).
    wall_s: float = 0.0
    server_cpu_main_s: float = 0.0
    server_cpu_other_s: float = 0.0
    client_cpu_s: float = 0.0
    #: Cores busy machine-wide, and the part neither the server nor our clients used.
    machine_cores: float = 0.0
    others_cores: float = 0.0
    #: Share of the time some task on the machine was runnable but waiting for a CPU.
    cpu_stall: float | None = None
    errors: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    met: bool | None = None
    correct: bool = True
    skipped: str = ""
    #: Wall-clock time the writers were told to start (to place GC pauses on the timeline).
    go_at: float = 0.0


def _head(server: ServerProcess, sub_doc: str) -> int:
    url = f"{server.url}/v1/workspaces/{WORKSPACE}/docs/{sub_doc}/ops?since=0&limit=1"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {server.token}"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return int(json.loads(resp.read())["clock"])


# -- one scenario --------------------------------------------------------------------------------


def run_scenario(
    scenario: Scenario,
    workdir: Path,
    *,
    database_url: str | None = None,
    profile_dir: Path | None = None,
    transport: Transport = "aiohttp",
) -> Report:
    report = Report(scenario.key, scenario.title, scenario.target)
    profile = profile_dir / f"server-{scenario.key}" if profile_dir else None
    try:
        server = ServerProcess.start(
            workdir / f"oplog-{scenario.key}.db", database_url=database_url, profile_dir=profile
        )
    except ServerRefused as exc:
        report.skipped = str(exc)
        return report
    ctx = multiprocessing.get_context("spawn")
    control = Control(go=ctx.Event(), ready=ctx.Queue(), results=ctx.Queue(), inbox=None)
    procs: list[Any] = []
    inboxes: list[Any] = []
    try:
        target = Target(server.url, server.token, WORKSPACE)
        _head(server, "warm")  # one request served: the idle figure includes a warm app
        report.rss_idle_mib = server.rss() / MIB

        sub_specs = _subscriber_specs(scenario, target)
        for spec in sub_specs:
            inbox = ctx.Queue()
            inboxes.append(inbox)
            proc = ctx.Process(
                target=worker_main,
                args=(spec, Control(control.go, control.ready, control.results, inbox)),
                name=spec.name,
            )
            proc.start()
            procs.append(proc)
        connect_times = _wait_ready(control, len(sub_specs), server, procs)
        report.connect_s = max(connect_times, default=0.0)
        report.rss_connected_mib = server.rss() / MIB

        writer_specs = _writer_specs(scenario, target, transport)
        for writer_spec in writer_specs:
            proc = ctx.Process(
                target=worker_main, args=(writer_spec, control), name=writer_spec.name
            )
            proc.start()
            procs.append(proc)
        _wait_ready(control, len(writer_specs), server, procs)

        server.reset_peak()
        cpu_before = server.cpu_seconds()
        load_before = MachineLoad.now()
        began = time.perf_counter()
        report.go_at = time.time()
        control.go.set()
        writers = _collect(control, len(writer_specs), scenario.duration_s + RESULT_SLACK_S)
        # CPU and machine load over the writing window only (go → last writer done): closing
        # 10,000 sockets afterwards is not part of what an op costs.
        wall = time.perf_counter() - began
        cpu_after = server.cpu_seconds()
        report.machine_cores, report.cpu_stall = MachineLoad.now().since(load_before)
        report.wall_s = wall
        report.server_cpu_main_s = cpu_after[0] - cpu_before[0]
        report.server_cpu_other_s = cpu_after[1] - cpu_before[1]
        finals, digests = _finals(writers, report)
        for inbox in inboxes:
            inbox.put(finals)
        subscribers = _collect(control, len(sub_specs), RESULT_SLACK_S)
        report.rss_peak_mib = server.peak_rss() / MIB
        _summarise(report, scenario, writers, subscribers, (finals, digests), wall)
        if scenario.subscribers == 0:
            _check_heads(report, server, writers)
    except (RuntimeError, TimeoutError, OSError) as exc:
        # A dead client, a dead server or a timeout: report it and go on to the next scenario.
        report.correct = False
        report.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        code = server.stop()
        if code not in (0, -15):
            report.errors.append(f"server exited {code}: {server.stderr_tail()}")
    if profile is not None and profile.exists():
        report.checks.append(f"server CPU profiles (one per thread) written to {profile}")
    return report


def _writer_specs(scenario: Scenario, target: Target, transport: Transport) -> list[WriterSpec]:
    specs = []
    per_proc = -(-scenario.writers // scenario.writer_procs)
    for p in range(scenario.writer_procs):
        first = p * per_proc
        count = min(per_proc, scenario.writers - first)
        if count <= 0:
            break
        specs.append(
            WriterSpec(
                name=f"writer-{scenario.key}{p}",
                target=target,
                sub_docs=scenario.write_docs,
                writers=count,
                first=first,
                batch=scenario.batch,
                duration_s=scenario.duration_s,
                max_requests=scenario.max_requests,
                rate=scenario.rate,
                keep_acks=scenario.subscribers > 0,
                warm_sub_doc=f"warm-{scenario.key}",
                transport=transport,
            )
        )
    return specs


def _subscriber_specs(scenario: Scenario, target: Target) -> list[SubscriberSpec]:
    specs: list[SubscriberSpec] = []
    if not scenario.subscribers:
        return specs
    per_proc = -(-scenario.subscribers // scenario.subscriber_procs)
    for p in range(scenario.subscriber_procs):
        first = p * per_proc
        count = min(per_proc, scenario.subscribers - first)
        if count <= 0:
            break
        specs.append(
            SubscriberSpec(
                name=f"subscriber-{scenario.key}{p}",
                target=target,
                sub_docs=scenario.watch_docs or scenario.write_docs,
                connections=count,
                first=first,
                each_all=scenario.each_all,
            )
        )
    return specs


def _wait_ready(
    control: Control, count: int, server: ServerProcess, procs: list[Any]
) -> list[float]:
    times: list[float] = []
    deadline = time.monotonic() + READY_TIMEOUT_S
    while len(times) < count:
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server died: {server.stderr_tail()}")
        dead = [proc.name for proc in procs if proc.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"client processes died before getting ready: {dead}")
        if not control.results.empty():
            failed = control.results.get()
            raise RuntimeError(f"a client process failed while getting ready: {failed}")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{count - len(times)} client processes never got ready")
        try:
            _, seconds = control.ready.get(timeout=min(1.0, remaining))
        except queue.Empty:  # poll the server and the results again
            continue
        times.append(seconds)
    return times


def _collect(control: Control, count: int, timeout: float) -> list[Any]:
    results: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(results) < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{count - len(results)} client processes sent no result")
        result = control.results.get(timeout=remaining)
        if isinstance(result, WorkerFailed):
            raise RuntimeError(f"client process {result.name} failed:\n{result.error}")
        results.append(result)
    return results


def _finals(writers: list[WriterResult], report: Report) -> tuple[dict[str, int], dict[str, str]]:
    """Final clock and expected subscriber digest per written sub-doc, after checking that the
    acked clocks are exactly 1..N (every op on these sub-docs is ours)."""
    by_doc: dict[str, list[tuple[int, str]]] = {}
    for result in writers:
        for sub_doc, clock, op_id in result.acks:
            by_doc.setdefault(sub_doc, []).append((clock, op_id))
    finals: dict[str, int] = {}
    for sub_doc, acks in by_doc.items():
        acks.sort()
        clocks = [clock for clock, _ in acks]
        if clocks != list(range(1, len(clocks) + 1)):
            report.correct = False
            report.errors.append(f"{sub_doc}: acked clocks are not 1..{len(clocks)}")
        finals[sub_doc] = clocks[-1] if clocks else 0
    digests = {sub_doc: digest_of(acks) for sub_doc, acks in by_doc.items()}
    return finals, digests


def _summarise(
    report: Report,
    scenario: Scenario,
    writers: list[WriterResult],
    subscribers: list[SubscriberResult],
    expected: tuple[dict[str, int], dict[str, str]],
    wall: float,
) -> None:
    started = min(w.started for w in writers)
    ended = max(w.ended for w in writers)
    report.duration_s = ended - started
    report.ops = sum(w.ops for w in writers)
    report.requests = sum(w.requests for w in writers)
    report.ops_per_s = report.ops / report.duration_s if report.duration_s > 0 else 0.0
    report.ack_ms = percentiles([ms for w in writers for ms in w.ack_ms])
    report.broadcast_ms = percentiles([ms for s in subscribers for ms in s.broadcast_ms])
    report.frames = sum(s.frames for s in subscribers)
    cpu = sum(w.cpu_s for w in writers) + sum(s.cpu_s for s in subscribers)
    report.client_cpu_s = cpu
    ours = cpu + report.server_cpu_main_s + report.server_cpu_other_s
    report.others_cores = max(0.0, report.machine_cores - ours / wall)
    for w in writers:
        report.errors.extend(f"{w.name}: {e}" for e in w.error_samples)
        if w.http_errors or w.op_errors:
            report.errors.append(f"{w.name}: {w.http_errors} HTTP errors, {w.op_errors} op errors")
    if subscribers:
        _check_subscribers(report, scenario, subscribers, *expected)
    report.met = _met(report, scenario)


def _check_subscribers(
    report: Report,
    scenario: Scenario,
    subscribers: list[SubscriberResult],
    finals: dict[str, int],
    digests: dict[str, str],
) -> None:
    watched = scenario.watch_docs or scenario.write_docs
    expected_watches = scenario.subscribers * (len(watched) if scenario.each_all else 1)
    seen = {key: value for s in subscribers for key, value in s.seen.items()}
    wrong = [
        key
        for key, (last, digest) in seen.items()
        if last != finals.get(key[1], 0) or digest != digests.get(key[1], digest_of([]))
    ]
    violations = sum(s.violations for s in subscribers)
    closes = sum(s.unexpected_closes for s in subscribers)
    failures = sum(s.connect_failures for s in subscribers)
    for s in subscribers:
        report.errors.extend(f"{s.name}: {e}" for e in s.error_samples)
    ok = not wrong and not violations and not closes and not failures
    ok = ok and len(seen) == expected_watches
    report.checks.append(
        f"exactly-once in order: {len(seen) - len(wrong)}/{expected_watches} subscriptions saw"
        f" every acked op once, in clock order ({violations} out-of-order/duplicate frames,"
        f" {closes} unexpected closes, {failures} failed connects)"
    )
    if not ok:
        report.correct = False


def _check_heads(report: Report, server: ServerProcess, writers: list[WriterResult]) -> None:
    """The server's head clock per sub-doc equals the ops it acknowledged there (all fresh)."""
    per_doc: dict[str, int] = {}
    for w in writers:
        for sub_doc, count in w.per_doc.items():
            per_doc[sub_doc] = per_doc.get(sub_doc, 0) + count
    bad = {doc: (count, _head(server, doc)) for doc, count in per_doc.items()}
    bad = {doc: pair for doc, pair in bad.items() if pair[0] != pair[1]}
    if bad:
        report.correct = False
        report.errors.append(f"head != acked ops on {bad}")
    report.checks.append(f"server head == acked ops on {len(per_doc) - len(bad)}/{len(per_doc)}")


def _met(report: Report, scenario: Scenario) -> bool:
    if scenario.key == "a":
        return report.ops_per_s >= 5_000
    if scenario.key == "b":
        return report.ops_per_s >= 50_000
    if scenario.key == "c":
        return report.correct and report.broadcast_ms.get("p99", float("inf")) <= 20.0
    return report.correct and report.rss_peak_mib <= 1024.0


# -- output --------------------------------------------------------------------------------------


def _fmt_pct(values: dict[str, float]) -> str:
    if not values:
        return "-"
    return (
        f"p50 {values['p50']:.1f} ms  p99 {values['p99']:.1f} ms  max {values['max']:.1f} ms"
        f"  (n={int(values['n']):,})"
    )


def _per_op(cpu_s: float, ops: int) -> str:
    return f"{cpu_s / ops * 1e6:.0f} us" if ops else "-"


def render(report: Report) -> str:
    head = f"({report.key}) {report.title}"
    if report.skipped:
        return f"{head}\n    skipped: {report.skipped}"
    verdict = "MET" if report.met else "MISSED"
    wall = report.wall_s or 1.0
    lines = [
        head,
        f"    target           {report.target}: {verdict}",
        f"    committed        {report.ops:,} ops in {report.requests:,} requests over"
        f" {report.duration_s:.1f} s = {report.ops_per_s:,.0f} ops/s",
        f"    ack latency      {_fmt_pct(report.ack_ms)}",
        f"    broadcast        {_fmt_pct(report.broadcast_ms)}",
        f"    server RSS       idle {report.rss_idle_mib:.0f} MiB, connected"
        f" {report.rss_connected_mib:.0f} MiB, peak while writing {report.rss_peak_mib:.0f} MiB",
        f"    CPU              server event-loop thread {report.server_cpu_main_s / wall:.2f}"
        f" cores, other threads {report.server_cpu_other_s / wall:.2f} cores;"
        f" clients {report.client_cpu_s / wall:.2f} cores",
        f"    CPU per op       server {_per_op(report.server_cpu_main_s, report.ops)} event loop"
        f" + {_per_op(report.server_cpu_other_s, report.ops)} other threads;"
        f" clients {_per_op(report.client_cpu_s, report.ops)}",
    ]
    stall = "n/a" if report.cpu_stall is None else f"{report.cpu_stall:.0%}"
    lines.append(
        f"    machine          {report.machine_cores:.2f} of {os.cpu_count()} cores busy, of which"
        f" {report.others_cores:.2f} by other processes; CPU stall {stall}"
    )
    if report.connect_s:
        lines.append(f"    connect+sync     {report.connect_s:.1f} s (slowest client process)")
    lines.extend(f"    check            {check}" for check in report.checks)
    if not report.correct:
        lines.append("    CORRECTNESS FAILURE")
    lines.extend(f"    error            {error}" for error in report.errors[:10])
    return "\n".join(lines)


def print_profile(directory: Path, go_at: float = 0.0, limit: int = 20) -> None:
    """Each thread's CPU profile, heaviest functions first (own time, then cumulative), and
    the server's garbage-collector pauses."""
    gc_stats = directory / "gc.json"
    if gc_stats.exists():
        data = json.loads(gc_stats.read_text())
        print(f"\n== {directory.name}: GC pauses per generation ==")
        for generation, entry in sorted(data["generations"].items()):
            print(
                f"gen {generation}: {int(entry['count'])} collections, total"
                f" {entry['total_s'] * 1000:.0f} ms, worst {entry['max_s'] * 1000:.1f} ms"
            )
        for at, generation, pause in data["long_pauses"]:
            when = f"{at - go_at:+.1f} s from go" if go_at else f"at {at:.1f}"
            print(f"  gen {generation} pause {pause * 1000:.0f} ms, {when}")
    for path in sorted(directory.glob("*.prof")):
        stats = pstats.Stats(str(path))
        if stats.total_tt < 0.05:  # type: ignore[attr-defined]  # idle helper threads
            continue
        print(f"\n== {directory.name}/{path.name}: CPU seconds by own time ==")
        stats.sort_stats("tottime").print_stats(limit)
        print(f"== {directory.name}/{path.name}: by cumulative time ==")
        stats.sort_stats("cumulative").print_stats(limit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.oplog", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="5 s phases instead of 20 s")
    parser.add_argument("--scenario", choices=["a", "b", "c", "d", "all"], default="all")
    parser.add_argument("--database-url", default=None, help="PostgreSQL DSN for the server")
    parser.add_argument(
        "--profile", type=Path, default=None, help="run the server under cProfile into this dir"
    )
    parser.add_argument(
        "--writers",
        choices=["aiohttp", "raw", "socket"],
        default="aiohttp",
        help="how writers send: HTTP POST with aiohttp (default), HTTP POST with a bare"
        " HTTP/1.1 client (less client CPU), or websocket apply frames",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    nofile = raise_nofile()
    chosen = scenarios(args.quick)
    keys = list(chosen) if args.scenario == "all" else [args.scenario]
    reports: list[Report] = []
    with tempfile.TemporaryDirectory(prefix="cv-bench-oplog-") as tmp:
        workdir = Path(tmp)
        fsync_ms = fsync_probe_ms(workdir)
        backend = "PostgreSQL" if args.database_url else "SQLite synchronous=FULL, WAL"
        print(
            f"op-log benchmark: {'quick' if args.quick else 'full'} run, backend {backend};"
            f" writers {WRITERS[args.writers]}; fsync probe {fsync_ms:.1f} ms;"
            f" fd limit {nofile:,}; python {sys.version.split()[0]}",
            flush=True,
        )
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
            print("server runs under cProfile (all threads): expect lower figures", flush=True)
        for key in keys:
            began = time.perf_counter()
            report = run_scenario(
                chosen[key],
                workdir,
                database_url=args.database_url,
                profile_dir=args.profile,
                transport=args.writers,
            )
            reports.append(report)
            print(render(report), flush=True)
            print(f"    (scenario took {time.perf_counter() - began:.0f} s)\n", flush=True)
            if report.skipped:
                print("the server refused these arguments: remaining scenarios skipped")
                break  # every other scenario would be refused the same way
    if args.profile is not None:
        for report in reports:
            directory = args.profile / f"server-{report.key}"
            if directory.exists():
                print_profile(directory, report.go_at)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in reports], indent=2) + "\n")
    return 0 if all(r.correct for r in reports) else 1


if __name__ == "__main__":
    raise SystemExit(main())
