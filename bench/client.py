"""Client SDK benchmark (issue 4): `WorkspaceClient` against the real `cv-server` process.

    python -m bench.client [--quick] [--no-peer] [--part 1|2|all] [--profile DIR] [--json PATH]
        [--peer-db memory|pg|both] [--database-url DSN] [--backends sqlite,postgres]

Every client runs in its own spawned process (never in the server's), durable on both sides: the
writers' outbox is a SQLite file (the SDK's default: each op committed to the file before its first
send, fsynced alongside it) unless a line says "memory outbox", and the server's database is a
fresh SQLite file per phase (WAL, `synchronous=FULL`: an op is fsynced before it is acknowledged).

0. The client alone (no server): µs per op of the state machine and of the outbox write path,
   and µs per delivered op on a subscriber's side of a broadcast.
1. One client, one sub-doc: pipelining over the websocket (many `apply_op` in flight, the SDK
   batches what is pending) against awaiting each op over HTTP (`ops_over_websocket=False`), with
   a file and a memory outbox. Target: pipelined >= 10x one at a time.
2. The ShareDB peer's workloads, each writer awaiting its ack before its next op, over the
   websocket: 1 writer / 1 sub-doc; 4 writers + 4 subscribers on 1 and on 4 sub-docs; 16 + 16 on
   16; 64 writers on 64. ShareDB 7 (memory database, not durable) runs the same workloads in the
   same run (`shared/peers/sharedb-bench.js`); `--no-peer` skips it. Target: match it.
   `--peer-db pg` (or `both`) runs ShareDB with sharedb-postgres too, the peer's own durable
   setup (each op committed to PostgreSQL before its ack), on a scratch database per run;
   `--backends sqlite,postgres` runs ours on PostgreSQL as well (a fresh schema per phase, on the
   server of `--database-url`), so durable meets durable on the same database server.
   Two layouts of ours (`--layout`): each writer its own `WorkspaceClient` (own socket, own
   outbox file: the peer gives each writer its own connection), and one client per writer
   process shared by its writers (how an app uses the SDK: one client per process); writers sit
   in 1 process (up to 4 writers) or 2, subscribers likewise.

`--profile DIR`: the client processes run under cProfile (event-loop thread, CPU time) and the
server under `bench._profiled_server`; the heaviest functions are printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Final

import asyncpg  # type: ignore[import-untyped]

from bench._client_delivery import measure_delivery
from bench._client_outbox import OutboxFigure, measure_outbox
from bench._client_peer import Peer, PeerFigures, find_peer, run_peer, scratch_peer_database
from bench._client_phase import Phase, run_phase, warm_sub_docs, workspace_name
from bench._client_workers import SubscriberJob, Transport, WriterJob
from bench._procs import ServerProcess, ServerRefused, fsync_probe_ms, raise_nofile
from bench._progress import runs
from bench.oplog import print_profile
from bench.pg_instances import DEFAULT_DSN, fresh_schema, with_schema

REPO_ROOT: Final = Path(__file__).resolve().parent.parent
#: apply_op calls one pipelining client keeps in flight.
PIPELINE_WINDOW: Final = 500


@dataclass(frozen=True, slots=True)
class Single:
    """Part 1: one client, one sub-doc."""

    key: str
    label: str
    window: int
    transport: Transport
    file_outbox: bool
    ops: int


@dataclass(frozen=True, slots=True)
class Workload:
    """Part 2: the peer's workload `writers` / `subs` / `docs`."""

    key: str
    label: str
    writers: int
    subs: int
    docs: int
    #: ShareDB's figure from the peer README (10,000 ops, memory DB, this machine kind).
    peer_readme_ops_s: float


@dataclass(slots=True)
class Row:
    key: str
    label: str
    ours: Phase
    peer: PeerFigures | None = None
    peer_skipped: str = ""
    #: ShareDB on sharedb-postgres (durable), when `--peer-db` asks for it.
    peer_pg: PeerFigures | None = None


@dataclass(slots=True)
class Report:
    quick: bool
    loadavg_start: tuple[float, float, float]
    fsync_ms: float
    outbox: list[OutboxFigure] = field(default_factory=list)
    singles: list[Row] = field(default_factory=list)
    workloads: list[Row] = field(default_factory=list)


def singles(quick: bool) -> list[Single]:
    piped = 20_000 if quick else 60_000
    one = 1_000 if quick else 3_000
    window = PIPELINE_WINDOW
    return [
        Single("pipe-file", "pipelined, websocket, file outbox", window, "websocket", True, piped),
        Single(
            "pipe-mem", "pipelined, websocket, memory outbox", window, "websocket", False, piped
        ),
        Single("http-file", "one at a time, HTTP, file outbox", 1, "http", True, one),
        Single("http-mem", "one at a time, HTTP, memory outbox", 1, "http", False, one),
        Single("ws-file", "one at a time, websocket, file outbox", 1, "websocket", True, one),
        Single("ws-mem", "one at a time, websocket, memory outbox", 1, "websocket", False, one),
        Single("bare", "one at a time, bare websocket (no SDK, no outbox)", 1, "bare", False, one),
    ]


WORKLOADS: Final = (
    Workload("w1-d1", "1 writer, 1 sub-doc", 1, 0, 1, 6_200),
    Workload("w4s4-d1", "4 writers + 4 subs, 1 sub-doc", 4, 4, 1, 5_700),
    Workload("w4s4-d4", "4 writers + 4 subs, 4 sub-docs", 4, 4, 4, 8_900),
    Workload("w16s16-d16", "16 writers + 16 subs, 16 sub-docs", 16, 16, 16, 5_300),
    Workload("w64-d64", "64 writers, 64 sub-docs", 64, 0, 64, 15_200),
)


def _docs(workload: Workload) -> tuple[str, ...]:
    return tuple(f"doc{i}" for i in range(workload.docs))


def _profile_path(profile: Path | None, key: str, name: str) -> str | None:
    return str(profile / f"client-{key}" / f"{name}.prof") if profile else None


def _split(count: int, parts: int) -> list[range]:
    per = -(-count // parts)
    return [range(p * per, min(count, (p + 1) * per)) for p in range(parts) if p * per < count]


# -- part 1 ----------------------------------------------------------------------------------------


def run_singles(workdir: Path, quick: bool, profile: Path | None) -> list[Row]:
    rows: list[Row] = []
    try:
        server = ServerProcess.start(
            workdir / "single.db", profile_dir=profile / "server-single" if profile else None
        )
    except ServerRefused as exc:
        print(f"part 1 skipped: {exc}")
        return rows
    workspace = workspace_name()
    try:
        for single in singles(quick):
            outbox_dir = workdir / f"outbox-{single.key}"
            outbox_dir.mkdir()
            job = WriterJob(
                name=f"client-{single.key}",
                url=server.url,
                token=server.token,
                workspace=workspace,
                writers=((0, single.key),),
                ops_per_writer=single.ops,
                window=single.window,
                transport=single.transport,
                outbox_dir=str(outbox_dir) if single.file_outbox else None,
                time_cap_s=20.0 if quick else 60.0,
                keep_acks=True,
                profile_path=_profile_path(profile, single.key, "client"),
            )
            phase = run_phase(server, [job])
            row = Row(single.key, single.label, phase)
            rows.append(row)
            print(render_single(row), flush=True)
    finally:
        server.stop()
    return rows


# -- part 2 ----------------------------------------------------------------------------------------


def run_ours(
    workload: Workload,
    workdir: Path,
    ops: int,
    quick: bool,
    profile: Path | None,
    shared: bool,
    database_url: str | None = None,
) -> Phase:
    """Our side of a workload on a fresh server; `shared`: one client per writer process;
    `database_url`: the server on PostgreSQL (a schema of its own) instead of a SQLite file."""
    if database_url is not None:
        with fresh_schema(database_url) as schema:
            return _run_ours(
                workload, workdir, ops, quick, profile, shared, with_schema(database_url, schema)
            )
    return _run_ours(workload, workdir, ops, quick, profile, shared, None)


def _run_ours(
    workload: Workload,
    workdir: Path,
    ops: int,
    quick: bool,
    profile: Path | None,
    shared: bool,
    database_url: str | None,
) -> Phase:
    backend = "pg" if database_url else "sqlite"
    key = f"{workload.key}-{'shared' if shared else 'own'}-{backend}"
    docs = _docs(workload)
    per_writer = -(-ops // workload.writers)
    try:
        server = ServerProcess.start(
            workdir / f"{key}.db",
            database_url=database_url,
            profile_dir=profile / f"server-{key}" if profile else None,
        )
    except ServerRefused as exc:
        return Phase(correct=False, errors=[f"server refused: {exc}"])
    workspace = workspace_name()
    try:
        warm = warm_sub_docs(server, workspace, docs)
        outbox_dir = workdir / f"outbox-{key}"
        outbox_dir.mkdir()
        writer_jobs = [
            WriterJob(
                name=f"writers-{key}-{p}",
                url=server.url,
                token=server.token,
                workspace=workspace,
                writers=tuple((m, docs[m % workload.docs]) for m in part),
                ops_per_writer=per_writer,
                window=1,
                transport="websocket",
                shared_client=shared,
                outbox_dir=str(outbox_dir),
                time_cap_s=30.0 if quick else 90.0,
                keep_acks=True,
                profile_path=_profile_path(profile, key, f"writers-{p}"),
            )
            for p, part in enumerate(_split(workload.writers, 1 if workload.writers <= 4 else 2))
        ]
        sub_jobs = [
            SubscriberJob(
                name=f"subscribers-{key}-{p}",
                url=server.url,
                token=server.token,
                workspace=workspace,
                subscribers=len(part),
                first=part.start,
                sub_docs=docs,
                profile_path=_profile_path(profile, key, f"subscribers-{p}"),
            )
            for p, part in enumerate(_split(workload.subs, 1 if workload.subs <= 4 else 2))
            if workload.subs
        ]
        return run_phase(server, writer_jobs, sub_jobs, warm=warm)
    finally:
        server.stop()


def run_workload(
    workload: Workload,
    workdir: Path,
    ops: int,
    quick: bool,
    profile: Path | None,
    peer: Peer | str,
    layouts: Sequence[bool],
    *,
    backends: Sequence[str] = ("sqlite",),
    peer_dbs: Sequence[str] = ("memory",),
    dsn: str = DEFAULT_DSN,
) -> list[Row]:
    """Ours in each layout (False: a client per writer, True: shared) on each backend, then the
    peer on each of its databases."""
    rows = []
    with runs(len(backends) * len(layouts), f"bench.client {workload.key}") as bar:
        for backend in backends:
            for shared in layouts:
                bar.update()
                if shared and workload.writers == 1 and False in layouts:
                    continue  # one writer: sharing its client changes nothing
                label = f"{workload.label}{', shared client' if shared else ''}"
                label += ", PostgreSQL" if backend == "postgres" else ""
                url = dsn if backend == "postgres" else None
                phase = run_ours(workload, workdir, ops, quick, profile, shared, url)
                rows.append(Row(workload.key, label, phase))
    figures: dict[str, PeerFigures] = {}
    skipped = ""
    if isinstance(peer, str):
        skipped = peer
    else:
        for db in peer_dbs:
            figures[db] = _peer_figures(peer, workload, ops, db, dsn)
    for row in rows:
        row.peer, row.peer_pg, row.peer_skipped = figures.get("memory"), figures.get("pg"), skipped
    return rows


def _peer_figures(peer: Peer, workload: Workload, ops: int, db: str, dsn: str) -> PeerFigures:
    def run(count: int, env: dict[str, str] | None = None) -> PeerFigures:
        return run_peer(
            peer,
            ops=count,
            writers=workload.writers,
            subs=workload.subs,
            docs=workload.docs,
            db=db,
            env=env,
        )

    if db == "memory":
        figures = run(ops)
        # The same run without ops: start-up, connects and shutdown, taken off its CPU per op.
        figures.idle_cpu_s = run(0).cpu_s
        return figures
    # A scratch database per run: the idle run must not find the measured run's documents.
    try:
        with scratch_peer_database(peer, dsn) as env:
            figures = run(ops, env)
        with scratch_peer_database(peer, dsn) as env:
            figures.idle_cpu_s = run(0, env).cpu_s
    except (OSError, asyncpg.PostgresError) as exc:
        return PeerFigures(error=f"no scratch database for sharedb-postgres: {exc}")
    return figures


# -- output ----------------------------------------------------------------------------------------


def _pct(values: dict[str, float]) -> str:
    if not values:
        return "-"
    return (
        f"p50 {values['p50']:.2f} ms  p99 {values['p99']:.2f} ms  (n={int(values.get('n', 0)):,})"
    )


def _load(phase: Phase) -> str:
    stall = "n/a" if phase.cpu_stall is None else f"{phase.cpu_stall:.0%}"
    one, five, _ = phase.load
    return (
        f"load {one:.1f}/{five:.1f} (1/5 min) on {os.cpu_count()} cores; {phase.machine_cores:.2f}"
        f" cores busy, CPU stall {stall}"
    )


def _cpu(phase: Phase) -> str:
    if not phase.ops:
        return "-"
    us = 1e6 / phase.ops
    return (
        f"server {phase.server_cpu_main_s * us:.0f} us event loop +"
        f" {phase.server_cpu_other_s * us:.0f} us other threads;"
        f" clients {phase.client_cpu_main_s * us:.0f} us event loop +"
        f" {phase.client_cpu_other_s * us:.0f} us other threads (outbox)"
    )


def _phase_lines(phase: Phase) -> list[str]:
    lines = [
        f"    committed  {phase.ops:,} ops in {phase.duration_s:.2f} s"
        f" = {phase.ops_per_s:,.0f} ops/s",
        f"    ack        {_pct(phase.ack_ms)}",
    ]
    if phase.broadcast_ms:
        lines.append(f"    broadcast  {_pct(phase.broadcast_ms)}")
    lines.append(f"    CPU / op   {_cpu(phase)}")
    lines.append(f"    machine    {_load(phase)}")
    lines.extend(f"    check      {check}" for check in phase.checks)
    if not phase.correct:
        lines.append("    CORRECTNESS FAILURE")
    lines.extend(f"    error      {error[:300]}" for error in phase.errors[:6])
    return lines


def render_single(row: Row) -> str:
    return "\n".join([f"[1] {row.label}", *_phase_lines(row.ours)])


def render_workload(rows: list[Row]) -> str:
    lines = []
    for row in rows:
        lines += [f"[2] {row.label} (ours)", *_phase_lines(row.ours)]
    row = rows[-1]
    peer = row.peer
    if peer is None:
        lines.append(f"    ShareDB    skipped: {row.peer_skipped}")
    elif peer.error:
        lines.append(f"    ShareDB    failed: {peer.error}")
    else:
        lines.append(
            f"    ShareDB {peer.version} memory DB: {peer.ops:,} ops = {peer.ops_per_s:,.0f} ops/s;"
            f" ack {_pct(peer.ack_ms)}; broadcast {_pct(peer.broadcast_ms)};"
            f" all seen {peer.all_seen}; CPU {_peer_cpu_us(peer):,.0f} us/op (both processes,"
            " less an idle run's)"
        )
    pg = row.peer_pg
    if pg is not None and pg.error:
        lines.append(f"    ShareDB    sharedb-postgres failed: {pg.error}")
    elif pg is not None:
        lines.append(
            f"    ShareDB {pg.version} sharedb-postgres (durable): {pg.ops:,} ops ="
            f" {pg.ops_per_s:,.0f} ops/s; ack {_pct(pg.ack_ms)}; broadcast {_pct(pg.broadcast_ms)};"
            f" all seen {pg.all_seen}; CPU {_peer_cpu_us(pg):,.0f} us/op (node processes only)"
        )
    return "\n".join(lines)


def _peer_cpu_us(peer: PeerFigures) -> float:
    return (peer.cpu_s - peer.idle_cpu_s) / peer.ops * 1e6 if peer.ops else 0.0


def _our_cpu_us(phase: Phase) -> float:
    if not phase.ops:
        return 0.0
    total = phase.server_cpu_main_s + phase.server_cpu_other_s
    total += phase.client_cpu_main_s + phase.client_cpu_other_s
    return total / phase.ops * 1e6


def _ratio(ours: float, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}x" if theirs else "-"


def render_tables(report: Report) -> str:
    lines: list[str] = []
    by_key = {row.key: row for row in report.singles}
    if "pipe-file" in by_key and "http-file" in by_key:
        pipe, http = by_key["pipe-file"].ours, by_key["http-file"].ours
        ratio = pipe.ops_per_s / http.ops_per_s if http.ops_per_s else 0.0
        verdict = "MET" if ratio >= 10 else "MISSED"
        lines.append(
            f"pipelined (websocket, file outbox) / one at a time (HTTP, file outbox):"
            f" {pipe.ops_per_s:,.0f} / {http.ops_per_s:,.0f} = {ratio:.1f}x (target 10x: {verdict})"
        )
    pairs = (
        ("pipe-file", "pipe-mem", "file vs memory outbox, pipelined"),
        ("ws-file", "ws-mem", "file vs memory outbox, one at a time (websocket)"),
        ("ws-mem", "bare", "SDK (memory outbox) vs bare websocket, one at a time"),
    )
    for a, b, what in pairs:
        if a in by_key and b in by_key and by_key[a].ours.ops and by_key[b].ours.ops:
            lines.append(_versus(what, by_key[a].ours, by_key[b].ours))
    if report.workloads:
        lines += [
            "",
            "| workload | ours ops/s | ShareDB ops/s | ratio | ours ack p99 | ShareDB ack p99 |"
            " ratio | bcast p99 ours / ShareDB | CPU us/op ours / ShareDB | exactly once | load |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in report.workloads:
            ours, peer = row.ours, row.peer
            p_ops = peer.ops_per_s if peer and not peer.error else None
            p_ack = peer.ack_ms.get("p99") if peer and not peer.error else None
            p_bc = peer.broadcast_ms.get("p99") if peer and not peer.error else None
            p_cpu = _peer_cpu_us(peer) if peer and not peer.error else None
            o_ack = ours.ack_ms.get("p99")
            o_bc = ours.broadcast_ms.get("p99")
            ack_ratio = _ratio(o_ack, p_ack) if o_ack is not None else "-"
            lines.append(
                f"| {row.label} | {ours.ops_per_s:,.0f} | {_num(p_ops, 0)} |"
                f" {_ratio(ours.ops_per_s, p_ops)} | {_num(o_ack, 2, ' ms')} |"
                f" {_num(p_ack, 2, ' ms')} | {ack_ratio} |"
                f" {_num(o_bc, 1)} / {_num(p_bc, 1, ' ms')} |"
                f" {_our_cpu_us(ours):,.0f} / {_num(p_cpu, 0)} |"
                f" {'yes' if ours.correct else 'NO'} | {ours.load[0]:.1f} |"
            )
    durable = [row for row in report.workloads if row.peer_pg is not None]
    if durable:
        lines += [
            "",
            "Durable against durable (ShareDB on sharedb-postgres, same run):",
            "",
            "| workload | ours ops/s | ShareDB-pg ops/s | ratio | ours ack p99 |"
            " ShareDB-pg ack p99 | all seen ours / ShareDB-pg |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in durable:
            ours, pg = row.ours, row.peer_pg
            assert pg is not None
            ok = pg.ops and not pg.error
            p_ops = pg.ops_per_s if ok else None
            p_ack = pg.ack_ms.get("p99") if ok else None
            seen = "-" if pg.all_seen is None else ("yes" if pg.all_seen else "NO")
            lines.append(
                f"| {row.label} | {ours.ops_per_s:,.0f} | {_num(p_ops, 0)} |"
                f" {_ratio(ours.ops_per_s, p_ops)} | {_num(ours.ack_ms.get('p99'), 2, ' ms')} |"
                f" {_num(p_ack, 2, ' ms')} | {'yes' if ours.correct else 'NO'} / {seen} |"
            )
    return "\n".join(lines)


def _versus(what: str, a: Phase, b: Phase) -> str:
    """How much `a` costs over `b`: throughput, ack p50, client CPU per op."""

    def client_us(phase: Phase) -> float:
        return (phase.client_cpu_main_s + phase.client_cpu_other_s) / phase.ops * 1e6

    ack = a.ack_ms.get("p50", 0.0) - b.ack_ms.get("p50", 0.0)
    return (
        f"{what}: {a.ops_per_s:,.0f} vs {b.ops_per_s:,.0f} ops/s; ack p50 {ack * 1000:+,.0f} us;"
        f" client CPU {client_us(a) - client_us(b):+,.0f} us/op"
    )


def _num(value: float | None, digits: int, unit: str = "") -> str:
    return "-" if value is None else f"{value:,.{digits}f}{unit}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.client", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer ops (under ~2 min in all)")
    parser.add_argument("--no-peer", action="store_true", help="do not run ShareDB")
    parser.add_argument("--part", choices=["0", "1", "2", "all"], default="all")
    parser.add_argument("--only", default=None, help="part 2: run only this workload key")
    parser.add_argument("--ops", type=int, default=None, help="part 2: ops per workload")
    parser.add_argument(
        "--layout",
        choices=["own", "shared", "both"],
        default="both",
        help="part 2: each writer its own WorkspaceClient (like the peer's one connection per"
        " writer), one client per writer process shared by its writers, or both (default)",
    )
    parser.add_argument(
        "--peer-db",
        choices=["memory", "pg", "both"],
        default="memory",
        help="part 2: ShareDB on its memory database (default), on sharedb-postgres (durable), or"
        " both, in the same run",
    )
    parser.add_argument(
        "--backends",
        default="sqlite",
        help="part 2: our server's backends, comma-separated: sqlite (default), postgres",
    )
    parser.add_argument(
        "--database-url",
        default=DEFAULT_DSN,
        help="PostgreSQL server for sharedb-postgres's scratch databases and our postgres"
        " backend's scratch schemas (default: $CV_TEST_DATABASE_URL or the local server)",
    )
    parser.add_argument("--profile", type=Path, default=None, help="cProfile output directory")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or any(b not in ("sqlite", "postgres") for b in backends):
        parser.error("--backends takes sqlite and/or postgres, comma-separated")
    peer_dbs = {"memory": ["memory"], "pg": ["pg"], "both": ["memory", "pg"]}[args.peer_db]

    raise_nofile()
    peer: Peer | str = "--no-peer given" if args.no_peer else find_peer(REPO_ROOT)
    ops = args.ops or (2_000 if args.quick else 10_000)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cv-bench-client-") as tmp:
        workdir = Path(tmp)
        report = Report(args.quick, os.getloadavg(), fsync_probe_ms(workdir))
        one, five, fifteen = report.loadavg_start
        print(
            f"client SDK benchmark: {'quick' if args.quick else 'full'} run; python"
            f" {sys.version.split()[0]}; {os.cpu_count()} cores, load {one:.1f}/{five:.1f}/"
            f"{fifteen:.1f}; fsync probe {report.fsync_ms:.1f} ms; peer:"
            f" {peer if isinstance(peer, str) else 'ShareDB (memory DB)'}",
            flush=True,
        )
        if args.part in ("0", "all"):
            report.outbox = measure_outbox(workdir, quick=args.quick)
            report.outbox.append(measure_delivery(quick=args.quick))
            print("[0] the client alone (no server): outbox and machine, and a subscriber's side")
            for fig in report.outbox:
                note = f"  ({fig.note})" if fig.note else ""
                print(
                    f"    {fig.label:<42} {fig.ops:>6,} ops  {fig.wall_us:>8.1f} us/op wall"
                    f"  {fig.cpu_us:>7.1f} us/op CPU{note}",
                    flush=True,
                )
        if args.part in ("1", "all"):
            report.singles = run_singles(workdir, args.quick, args.profile)
        if args.part in ("2", "all"):
            chosen = [w for w in WORKLOADS if args.only in (None, w.key)]
            for workload in chosen:
                layouts = {"own": [False], "shared": [True], "both": [False, True]}[args.layout]
                rows = run_workload(
                    workload,
                    workdir,
                    ops,
                    args.quick,
                    args.profile,
                    peer,
                    layouts,
                    backends=backends,
                    peer_dbs=peer_dbs,
                    dsn=args.database_url,
                )
                report.workloads.extend(rows)
                print(render_workload(rows), flush=True)
    print()
    print(render_tables(report))
    print(f"\n(took {time.perf_counter() - began:.0f} s)")
    if args.profile is not None:
        for directory in sorted(args.profile.iterdir()):
            if directory.is_dir():
                print_profile(directory, limit=15)
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(report), indent=2, default=list) + "\n")
    rows = report.singles + report.workloads
    return 0 if all(row.ours.correct for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
