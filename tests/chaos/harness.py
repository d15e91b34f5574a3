"""One chaos run: real processes through fault proxies, a seeded fault schedule, every invariant.

For the run's fault phase it drives, concurrently:

- SDK writer processes with durable file outboxes (`tests.chaos.writer`; even ones send ops
  over the websocket, odd ones over HTTP), each through proxies that cut a share of server
  answers (after the commit, before the answer: the worst moment for a retry);
- subscriber clients following every sub-doc through a proxy whose connections are reset;
- `cv-worker` processes (durable outboxes) racing on overlapping `evaluate` requests (two
  non-coalescing requests per job) paid to the counting fake provider under the compute lock;
- an enqueuer sending those requests under `Idempotency-Key`s, some of them twice;
- one `cv-server` on SQLite, or three on one PostgreSQL schema.

The schedule (`tests.chaos.schedule`) SIGKILLs server instances, writers and workers (each
restarted: a server on its database and port, a writer or worker on its outbox), SIGTERMs
workers (they drain), cuts every open writer connection, resets subscriber links and, on
PostgreSQL, terminates one instance's database connections. Then the faults stop, every process
finishes, and `tests.chaos.invariants.check` judges what was recorded.

Servers are the real `cv-server serve`; writers and workers are forked by `tests.chaos.zygote`
(separate processes, restarted in milliseconds rather than seconds of imports).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sqlite3
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from cv_mutations import NodeInsert
from cv_workspace_client import (
    Committed,
    RequestOutcome,
    WorkspaceClient,
    WorkspaceError,
)
from cv_workspace_client.stages import JOBS
from cv_workspace_client.testing import FaultProxy
from tests.acceptance.procs import ServerProcess, free_port, mint_cli_token
from tests.acceptance.three_layers_procs import Proc, provider_stats, worker_cmd
from tests.chaos.invariants import History, RequestRecord, Verdict, check
from tests.chaos.plan import DOCS, WS, parse_op_id
from tests.chaos.schedule import Fault, FaultKind, Profile, schedule
from tests.chaos.writer import CHAOS_RETRY, read_log

__all__ = [
    "QUIESCE_S",
    "SERVER_SETTINGS",
    "Backend",
    "ChaosResult",
    "ChaosSpec",
    "default_profile",
    "figure_line",
    "run_chaos",
    "run_in_schema",
]

Backend = Literal["sqlite", "postgres"]

#: Durations the servers run with: a short lease, so a killed worker's request is re-driven
#: within seconds. The compute lock keeps its production TTL (60 s): a lock is only as good as
#: its TTL is longer than its holder's longest stall, and a server outage on a loaded machine
#: lasted 22 s, so a shrunk TTL let a second request compute and write a cell the first was
#: still writing (what is and is not promised: docs/reliability.md).
SERVER_SETTINGS: Final = (
    "lease_seconds=4",
    "failure_backoff_seconds=0.5",
)
#: How long a server may take to say it is listening (a loaded CI machine is slow to start one).
START_TIMEOUT_S: Final = 120.0
#: The most a fault waits for its target to be at work (see `_inject`).
GATE_S: Final = 15.0
#: Ops of a writer applied since its start before it may be killed again.
PROGRESS_OPS: Final = 5
#: Ops applied since a server's restart before a server may be killed again: a restart takes
#: seconds on a loaded machine, and killed again as soon as it answered, the one SQLite server
#: was down most of the run and the soak tested little but reconnects.
SERVER_PROGRESS_OPS: Final = 100
#: Bound on everything after the fault phase (writers settling, requests ending, catch-up).
QUIESCE_S: Final = 240.0


def default_profile(backend: Backend) -> Profile:
    """Mean seconds between faults of each kind: more than one kill a second, a cut every 4 s, a
    subscriber reset every 0.3 s (a CI run of ~75 s gets 50+ kills, 500+ cut connections)."""
    every: dict[FaultKind, float | None] = {
        "kill_writer": 1.5,
        "kill_worker": 3.0,
        "term_worker": 12.0,
        "kill_server": 12.0 if backend == "sqlite" else 8.0,
        "cut_writers": 4.0,
        "drop_subscribers": 0.3,
        "kill_backends": 4.0 if backend == "postgres" else None,
    }
    return Profile(every)


@dataclass(frozen=True)
class ChaosSpec:
    backend: Backend
    seconds: float
    seed: int
    workdir: Path
    #: PostgreSQL DSN with its `search_path` (the schema is the caller's); postgres only.
    database_url: str | None = None
    profile: Profile | None = None
    writers: int = 4
    #: Ops per second each writer intends.
    writer_rate: float = 12.0
    workers: int = 3
    subscribers: int = 4
    #: A new job (two requests) this often.
    enqueue_every: float = 1.5
    columns: int = 3
    #: Per server answer (HTTP proxies) / per server chunk after the 101 (websocket proxies).
    http_cut_p: float = 0.12
    ws_cut_p: float = 0.08
    #: Per server answer on the workers' and the enqueuer's links.
    worker_cut_p: float = 0.01
    provider_delay: float = 0.1
    #: How the workers claim and report: over their worker channel, or the HTTP verbs.
    worker_transport: str = "channel"

    @property
    def instances(self) -> int:
        return 3 if self.backend == "postgres" else 1


@dataclass
class ChaosResult:
    spec: ChaosSpec
    verdict: Verdict
    history: History
    wall_seconds: float

    @property
    def figure_line(self) -> str:
        return figure_line(self)


def figure_line(result: ChaosResult) -> str:
    """The run in one grep-able line: faults by kind; ops intended, acknowledged, applied,
    duplicated, lost; the other invariants; OK or FAILED."""
    f, spec, h = result.verdict.figures, result.spec, result.history
    faults = " ".join(f"{kind}={h.faults[kind]}" for kind in sorted(h.faults))
    violations = result.verdict.violations

    def holds(word: str, broken: bool) -> str:
        return f"NOT {word}" if broken else word

    clocks_bad = any("clocks are not" in v for v in violations)
    return (
        f"chaos {spec.backend} seed={spec.seed} seconds={spec.seconds:g}"
        f" workers={spec.worker_transport}"
        f" instances={spec.instances}: faults {faults};"
        f" {f['kills']} kills, {f['cut_connections']} cut connections;"
        f" ops intended={f['intended']} acknowledged={f['acknowledged']}"
        f" applied={f['applied']}, {f['duplicates']} duplicates, {f['lost']} lost,"
        f" {f['missing']} missing; {holds('clocks gap-free', clocks_bad)};"
        f" {f['subscribers'] - f['subscribers_diverged']}/{f['subscribers']} subscriptions saw"
        f" each clock once in order; requests={f['requests']} done={f['done']}"
        f" cancelled={f['cancelled']} poison={f['poison']};"
        f" provider calls={f['provider_calls']} for {f['cells']} cells"
        f" (+{f['worker_kills']} worker kills allowed);"
        f" {f['outboxes'] - f['outboxes_left']}/{f['outboxes']} outboxes empty;"
        f" wall={result.wall_seconds:.0f}s; "
        + ("OK" if result.verdict.ok else f"FAILED ({len(violations)} violations)")
    )


# -- processes ------------------------------------------------------------------------------------


class _Child:
    """A process the zygote forked: its pid, and its exit code once it ended."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    @property
    def running(self) -> bool:
        return not self.exited.done()

    def signal(self, sig: signal.Signals) -> None:
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    async def wait(self) -> int:
        return await asyncio.shield(self.exited)


class _Zygote:
    """The harness's side of `tests.chaos.zygote`: writers and workers are forked there."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc
        self._spawning: dict[int, asyncio.Future[int]] = {}
        self._children: dict[int, _Child] = {}
        self._next = 0
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, log: Path) -> _Zygote:
        with log.open("a") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.chaos.zygote",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=err,
            )  # fmt: skip
        assert proc.stdout is not None
        ready = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
        if b"ready" not in ready:
            raise RuntimeError(f"the zygote did not start; see {log}")
        return cls(proc)

    async def _read(self) -> None:
        assert self._proc.stdout is not None
        while line := await self._proc.stdout.readline():
            message = json.loads(line)
            if "spawned" in message:
                child = _Child(message["pid"])
                self._children[child.pid] = child
                self._spawning.pop(message["spawned"]).set_result(child.pid)
            elif "exited" in message:
                ended = self._children.pop(message["exited"], None)
                if ended is not None and not ended.exited.done():
                    ended.exited.set_result(message["code"])
        for child in self._children.values():  # the zygote died: so did its children
            if not child.exited.done():
                child.exited.set_result(-9)
        for future in self._spawning.values():
            if not future.done():
                future.set_exception(RuntimeError("the zygote exited"))

    async def spawn(self, kind: str, argv: list[str], log: Path) -> _Child:
        self._next += 1
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._spawning[self._next] = future
        assert self._proc.stdin is not None
        command = {"spawn": self._next, "kind": kind, "argv": argv, "log": str(log)}
        self._proc.stdin.write((json.dumps(command) + "\n").encode())
        await self._proc.stdin.drain()
        pid = await asyncio.wait_for(future, START_TIMEOUT_S)
        return self._children[pid]

    async def close(self) -> None:
        for child in list(self._children.values()):
            child.signal(signal.SIGKILL)
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            await asyncio.wait_for(self._proc.wait(), 30)
        except TimeoutError:
            self._proc.kill()
            await self._proc.wait()
        await self._reader


@dataclass
class _Writer:
    index: int
    args: list[str]
    log: Path
    outbox: Path
    acks: Path
    child: _Child | None = None
    #: `_Run.seen_of(index)` when the current process was started.
    mark: int = 0

    async def spawn(self, zygote: _Zygote) -> None:
        self.child = await zygote.spawn("writer", self.args, self.log)

    @property
    def running(self) -> bool:
        return self.child is not None and self.child.running


@dataclass
class _Worker:
    index: int
    #: `cv-worker`'s arguments.
    args: list[str]
    log: Path
    outbox: Path
    child: _Child | None = None

    async def spawn(self, zygote: _Zygote) -> None:
        self.child = await zygote.spawn("worker", self.args, self.log)

    @property
    def running(self) -> bool:
        return self.child is not None and self.child.running


@dataclass
class _Instance:
    server: ServerProcess
    #: Proxies in front of it: HTTP writers and the enqueuer, websocket writers, subscribers,
    #: workers.
    http: FaultProxy
    ws: FaultProxy
    sub: FaultProxy
    work: FaultProxy


class _Follower:
    """One subscription: every (clock, op_id) it was handed, duplicates included."""

    def __init__(self, name: str, client: WorkspaceClient, doc: str, changed: asyncio.Event):
        self.name = name
        self.doc = doc
        self.seen: list[tuple[int, str | None]] = []
        self.by_writer: Counter[int] = Counter()
        self._changed = changed
        self.task = asyncio.create_task(self._follow(client))

    @property
    def clock(self) -> int:
        return self.seen[-1][0] if self.seen else 0

    async def _follow(self, client: WorkspaceClient) -> None:
        try:
            async with client.subscribe(WS, self.doc, since=0) as subscription:
                async for committed in subscription:
                    assert isinstance(committed, Committed)  # never compacted here
                    self.seen.append((committed.clock, committed.op_id))
                    if (key := parse_op_id(committed.op_id)) is not None:
                        self.by_writer[key[0]] += 1
                    self._changed.set()
        finally:
            self._changed.set()


@dataclass
class _Run:
    spec: ChaosSpec
    token: str
    instances: list[_Instance]
    provider: Proc
    zygote: _Zygote
    started: float = field(default_factory=time.monotonic)
    fault_log: list[str] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    writers: list[_Writer] = field(default_factory=list)
    workers: list[_Worker] = field(default_factory=list)
    followers: list[_Follower] = field(default_factory=list)
    requests: dict[str, str] = field(default_factory=dict)  # request id -> job id
    key_answers: dict[str, set[str]] = field(default_factory=dict)
    #: Set whenever a subscriber was handed an op.
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    #: `progress()` when a server last came back.
    last_restart: int = 0

    def note(self, kind: str, target: object, detail: str = "") -> None:
        at = time.monotonic() - self.started
        self.fault_log.append(f"{at:9.3f}s {kind} {target} {detail}".rstrip())

    def progress(self) -> int:
        """Writer ops the first subscriber client was handed so far."""
        return sum(self.seen_of(w) for w in range(self.spec.writers))

    def seen_of(self, writer: int) -> int:
        """Ops of `writer` the first subscriber client was handed so far."""
        return sum(f.by_writer[writer] for f in self.followers if f.name == "s0")

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Until `predicate()` holds (checked whenever a subscriber is handed an op), or
        `GATE_S` passed: then on anyway, a fault schedule must not stall because the system
        did."""
        deadline = time.monotonic() + GATE_S
        while not predicate() and time.monotonic() < deadline:
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), deadline - time.monotonic())

    def proxies(self) -> list[FaultProxy]:
        return [p for i in self.instances for p in (i.http, i.ws, i.sub, i.work)]


async def run_chaos(spec: ChaosSpec) -> ChaosResult:
    """Run `spec` to the end and judge it (a failed invariant is in the verdict, not raised;
    a harness failure, such as a process that cannot start, raises)."""
    started = time.monotonic()
    spec.workdir.mkdir(parents=True, exist_ok=True)
    async with _cluster(spec) as run:
        history = await _drive(run)
    verdict = check(history)
    result = ChaosResult(spec, verdict, history, time.monotonic() - started)
    # Beside the processes' logs, so a failed run can be read after the fact.
    (spec.workdir / "verdict.txt").write_text(
        "\n".join([*history.fault_log, *(f"VIOLATION: {v}" for v in verdict.violations),
                   result.figure_line, ""])
    )  # fmt: skip
    return result


@asynccontextmanager
async def _cluster(spec: ChaosSpec) -> AsyncIterator[_Run]:
    work = spec.workdir
    if spec.backend == "postgres":
        if spec.database_url is None:
            raise ValueError("a postgres run needs database_url")
        token = await asyncio.to_thread(mint_cli_token, None, WS, database_url=spec.database_url)
    else:
        token = await asyncio.to_thread(mint_cli_token, work / "cv.db", WS)
    servers = [
        ServerProcess(
            None if spec.backend == "postgres" else work / "cv.db",
            free_port(),
            work / f"server{i}.log",
            database_url=spec.database_url if spec.backend == "postgres" else None,
            settings=SERVER_SETTINGS,
        )
        for i in range(spec.instances)
    ]
    provider = Proc(
        ["-m", "cv_workspace_client.stages.fake_provider", "--delay", str(spec.provider_delay)],
        work / "provider.log",
        "listening on",
    )
    async with AsyncExitStack() as stack:
        stack.callback(provider.stop)
        for server in servers:
            stack.callback(server.stop)
        await asyncio.gather(*(asyncio.to_thread(s.start, START_TIMEOUT_S) for s in servers))
        await asyncio.to_thread(provider.start)
        instances = []
        for n, server in enumerate(servers):
            proxies = [
                await stack.enter_async_context(
                    FaultProxy(server.url, seed=spec.seed * 31 + 4 * n + k)
                )
                for k in range(4)
            ]
            instances.append(_Instance(server, *proxies))
        zygote = await _Zygote.start(work / "zygote.log")
        stack.push_async_callback(zygote.close)
        run = _Run(spec, token, instances, provider, zygote)
        yield run


async def _drive(run: _Run) -> History:
    spec = run.spec
    work = spec.workdir
    for inst in run.instances:
        # The worst moment: the server committed, the answer is lost on the way back.
        inst.http.cut_chunks(spec.http_cut_p)
        inst.ws.cut_chunks(spec.ws_cut_p, skip_chunks=1)
        inst.work.cut_chunks(spec.worker_cut_p)
    admin_url = run.instances[0].server.url
    async with AsyncExitStack() as stack:
        admin = await stack.enter_async_context(
            WorkspaceClient(admin_url, token=run.token, config=CHAOS_RETRY)
        )
        for doc in DOCS:
            await admin.apply_op(
                WS, doc, NodeInsert(node_id="counter", parent_id="root", fields={"n": 0})
            )
        changed = run.changed
        for s in range(spec.subscribers):
            inst = run.instances[s % len(run.instances)]
            client = await stack.enter_async_context(
                WorkspaceClient(inst.sub.url, token=run.token, config=CHAOS_RETRY)
            )
            run.followers += [_Follower(f"s{s}", client, doc, changed) for doc in (*DOCS, JOBS)]

        async def close_followers() -> None:
            for follower in run.followers:
                follower.task.cancel()
            await asyncio.gather(*(f.task for f in run.followers), return_exceptions=True)

        stack.push_async_callback(close_followers)

        for w in range(spec.workers):
            inst = run.instances[w % len(run.instances)]
            outbox = work / f"worker{w}.outbox.db"
            command = worker_cmd(inst.work.url, run.token, run.provider.url, f"chaos{w}", 1.0)
            args = [
                *command[3:],
                "--outbox",
                str(outbox),
                "--transport",
                spec.worker_transport,
            ]  # without `-m cv_workspace_client.cli worker`
            run.workers.append(_Worker(w, args, work / f"worker{w}.log", outbox))
        for worker in run.workers:
            await worker.spawn(run.zygote)
        stack.push_async_callback(_stop_workers, run)

        until = time.time() + spec.seconds
        for i in range(spec.writers):
            inst = run.instances[i % len(run.instances)]
            transport = "ws" if i % 2 == 0 else "http"
            proxy = inst.ws if transport == "ws" else inst.http
            outbox, acks = work / f"writer{i}.outbox.db", work / f"writer{i}.acks"
            args = [proxy.url, run.token, str(i), str(outbox), transport, repr(until),
                    str(acks), str(spec.writer_rate)]  # fmt: skip
            run.writers.append(_Writer(i, args, work / f"writer{i}.log", outbox, acks))
        for writer in run.writers:
            await writer.spawn(run.zygote)

        faults = schedule(spec.seed, spec.seconds, spec.profile or default_profile(spec.backend),
                          _targets(spec))  # fmt: skip
        enqueuer_clients = [
            await stack.enter_async_context(
                WorkspaceClient(inst.http.url, token=run.token, config=CHAOS_RETRY)
            )
            for inst in run.instances
        ]
        phase_started = time.monotonic()
        enqueuer = asyncio.create_task(_enqueue(run, enqueuer_clients, until))
        await _execute(run, faults, phase_started)
        await enqueuer

        # -- quiesce: the faults stop, everything must converge ----------------------------------
        for proxy in run.proxies():
            proxy.cut_chunks(0)
        quiesce_deadline = time.monotonic() + QUIESCE_S
        codes = await _wait_writers(run, quiesce_deadline)
        for writer, code in zip(run.writers, codes, strict=True):
            if code != 0:
                run.note("writer_failed", writer.index, f"exit {code}; see {writer.log.name}")
        outcomes = await asyncio.gather(
            *(_wait_request(admin, rid, quiesce_deadline) for rid in sorted(run.requests))
        )
        logs = {doc: await read_log(admin, doc) for doc in (*DOCS, JOBS)}
        states = {doc: (await admin.get_state(WS, doc))[1].to_json() for doc in DOCS}
        heads = {doc: entries[-1].clock if entries else 0 for doc, entries in logs.items()}
        await _wait_caught_up(run, heads, changed, quiesce_deadline)
        stats = await asyncio.to_thread(provider_stats, run.provider.url)
        await _stop_workers(run)

    cut_connections = sum(p.stats.cuts + p.stats.dropped for p in run.proxies())
    return History(
        logs={
            doc: [(e.clock, e.op_id, e.op.model_dump(mode="json")) for e in entries]
            for doc, entries in logs.items()
        },
        jobs_doc=JOBS,
        states=states,
        acked={w.index: _read_acks(w.acks) for w in run.writers},
        seen={(f.name, f.doc): f.seen for f in run.followers},
        requests=[_record(run, outcome) for outcome in outcomes],
        key_answers=run.key_answers,
        columns=[f"c{c}" for c in range(spec.columns)],
        provider_calls=int(stats["calls"]),
        outbox_rows={
            p.name: _outbox_rows(p)
            for p in [*(w.outbox for w in run.writers), *(w.outbox for w in run.workers)]
        },
        faults=run.faults,
        cut_connections=cut_connections,
        fault_log=run.fault_log,
    )


def _targets(spec: ChaosSpec) -> dict[FaultKind, int]:
    return {
        "kill_server": spec.instances,
        "kill_writer": spec.writers,
        "kill_worker": spec.workers,
        "term_worker": spec.workers,
        "cut_writers": 1,
        "drop_subscribers": 1,
        "kill_backends": spec.instances if spec.backend == "postgres" else 0,
    }


# -- faults ---------------------------------------------------------------------------------------


async def _execute(run: _Run, faults: list[Fault], phase_started: float) -> None:
    """One executor per fault kind and target, each running its faults in time order (a fault
    that comes due while the previous one on its target is still restarting runs right after
    it); a worker's kill and terminate share one, so it is never killed and terminated at
    once."""
    lanes: dict[str, list[Fault]] = {}
    for fault in faults:
        kind = "worker" if fault.kind in ("kill_worker", "term_worker") else fault.kind
        lanes.setdefault(f"{kind}{fault.target}", []).append(fault)

    async def lane(items: list[Fault]) -> None:
        for fault in items:
            delay = phase_started + fault.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # the schedule's own clock, not a wait for a state
            if await _inject(run, fault):
                run.faults[fault.kind] += 1

    await asyncio.gather(*(lane(items) for items in lanes.values()))


async def _inject(run: _Run, fault: Fault) -> bool:
    """Inject one fault; False when its target had already finished (nothing to hit)."""
    kind, target = fault.kind, fault.target
    if kind == "kill_server":
        server = run.instances[target].server
        # Mid-run: the ops applied since the last restart went up first (killed again before
        # its clients were back, a server would only be tested on its start-up).
        mark = run.last_restart
        await run.wait_for(
            lambda: (
                run.progress() >= mark + SERVER_PROGRESS_OPS
                or not any(w.running for w in run.writers)
            )
        )
        await asyncio.to_thread(server.kill)
        run.note(kind, f"server{target}")
        await asyncio.to_thread(server.start, START_TIMEOUT_S)
        run.note("restarted", f"server{target}")
        run.last_restart = run.progress()
        return True
    if kind == "kill_writer":
        writer = run.writers[target]
        # Mid-stream: a writer is killed once its ops are flowing again since its last start (on
        # a loaded machine a process takes seconds to start: killed on a timer alone, writers
        # were killed before their first op, and the run tested nothing but start-ups).
        mark = writer.mark
        await run.wait_for(lambda: run.seen_of(target) >= mark + PROGRESS_OPS or not writer.running)
        if not writer.running:
            return False
        assert writer.child is not None
        writer.child.signal(signal.SIGKILL)
        await writer.child.wait()
        run.note(kind, f"writer{target}")
        writer.mark = run.seen_of(target)
        await writer.spawn(run.zygote)
        return True
    if kind in ("kill_worker", "term_worker"):
        worker = run.workers[target]
        assert worker.child is not None
        if kind == "kill_worker":
            worker.child.signal(signal.SIGKILL)
            await worker.child.wait()
        else:
            worker.child.signal(signal.SIGTERM)
            code = await asyncio.wait_for(worker.child.wait(), 60)
            if code != 0:
                run.note("worker_failed", f"worker{target}", f"drained with exit {code}")
        run.note(kind, f"worker{target}")
        await worker.spawn(run.zygote)
        return True
    if kind == "cut_writers":
        armed = sum(p.cut_open() for i in run.instances for p in (i.http, i.ws))
        run.note(kind, "all", f"{armed} connections armed")
        return True
    if kind == "drop_subscribers":
        dropped = sum(i.sub.drop_all() for i in run.instances)
        run.note(kind, "all", f"{dropped} connections")
        return True
    if kind == "kill_backends":
        killed = await _terminate_backends(run, run.instances[target].server)
        run.note(kind, f"server{target}", f"{killed} database connections")
        return True
    raise AssertionError(kind)


async def _terminate_backends(run: _Run, server: ServerProcess) -> int:
    """`pg_terminate_backend` of every database connection of `server` (and only its: the
    database is shared), found by the local ports of its process's sockets to PostgreSQL."""
    import asyncpg  # type: ignore[import-untyped]
    import psutil  # type: ignore[import-untyped]

    if server.proc is None or server.proc.poll() is not None:
        return 0
    try:
        conns = psutil.Process(server.proc.pid).net_connections(kind="tcp")
    except psutil.Error:
        return 0
    ports = [c.laddr.port for c in conns if c.raddr and c.raddr.port == 5432]
    if not ports:
        return 0
    assert run.spec.database_url is not None
    conn = await asyncpg.connect(run.spec.database_url)
    try:
        killed = await conn.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND client_port = ANY($1::int[])",
            ports,
        )
    finally:
        await conn.close()
    return int(killed)


# -- the enqueuer ---------------------------------------------------------------------------------


async def _enqueue(run: _Run, clients: list[WorkspaceClient], until: float) -> None:
    """A job every `enqueue_every` s, two non-coalescing requests each under its own
    Idempotency-Key, through the cutting proxies; a third of the keys are sent again (a client
    that never heard the first answer), and must get the same request id."""
    spec = run.spec
    rng = random.Random(spec.seed ^ 0x5EED)
    columns = [{"name": f"c{c}", "prompt": f"Chaos criterion {c}."} for c in range(spec.columns)]
    n = 0
    while time.time() < until:
        job = f"J{n:05d}"
        client = clients[n % len(clients)]
        n += 1
        for r in range(2):
            key = f"chaos-{job}-{r}"
            for _ in range(2 if rng.random() < 1 / 3 else 1):
                rid = await _enqueue_one(client, job, key, columns, time.monotonic() + QUIESCE_S)
                run.requests[rid] = job
                run.key_answers.setdefault(key, set()).add(rid)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), spec.enqueue_every)  # the pace


async def _enqueue_one(
    client: WorkspaceClient, job: str, key: str, columns: list[dict[str, str]], deadline: float
) -> str:
    while True:
        try:
            enqueued = await client.enqueue(
                WS, stage="evaluate", job_id=job, input={"columns": columns},
                deterministic=False, idempotency_key=key,
            )  # fmt: skip
            return enqueued.request_id
        except WorkspaceError as exc:
            # Its tries used up through a restart: the same key again (never a new request).
            if not exc.retryable or time.monotonic() > deadline:
                raise


# -- the end --------------------------------------------------------------------------------------


async def _wait_writers(run: _Run, deadline: float) -> list[int]:
    codes = []
    for writer in run.writers:
        assert writer.child is not None
        try:
            async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
                codes.append(await writer.child.wait())
        except TimeoutError:
            writer.child.signal(signal.SIGKILL)
            codes.append(await writer.child.wait())
    return codes


async def _wait_request(admin: WorkspaceClient, rid: str, deadline: float) -> RequestOutcome:
    while True:
        try:
            return await admin.wait_request(WS, rid, timeout=max(1.0, deadline - time.monotonic()))
        except WorkspaceError as exc:
            if not exc.retryable or time.monotonic() > deadline:
                raise


async def _wait_caught_up(
    run: _Run, heads: dict[str, int], changed: asyncio.Event, deadline: float
) -> None:
    def behind() -> list[_Follower]:
        return [f for f in run.followers if f.clock < heads[f.doc] and not f.task.done()]

    while behind() and time.monotonic() < deadline:
        changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), max(0.1, deadline - time.monotonic()))


def _record(run: _Run, outcome: RequestOutcome) -> RequestRecord:
    result = outcome.result if isinstance(outcome.result, dict) else {}
    computed = tuple(f"eval:{name}" for name in result.get("computed", []))
    status: str = outcome.status
    return RequestRecord(outcome.request_id, run.requests[outcome.request_id], status, computed)


def _read_acks(path: Path) -> set[str]:
    if not path.exists():
        return set()
    # A writer killed mid-write may leave a torn last line: only whole op_ids count.
    return {line for line in path.read_text().split("\n")[:-1] if line.startswith("chaos-w")}


def _outbox_rows(path: Path) -> int:
    if not path.exists():
        return 0
    with contextlib.closing(sqlite3.connect(path)) as db:
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
        if "outbox" not in tables:
            return 0
        return int(db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0])


async def _stop_workers(run: _Run) -> None:
    """SIGTERM every worker (they drain), bounded; the zygote kills whatever is left."""
    for worker in run.workers:
        if worker.child is not None:
            worker.child.signal(signal.SIGTERM)
    for worker in run.workers:
        if worker.child is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.child.wait(), 60)


async def run_in_schema(
    base_url: str, body: Callable[[str], Awaitable[ChaosResult]]
) -> ChaosResult:
    """Run `body(database_url)` in a fresh PostgreSQL schema, dropped afterwards."""
    from cv_server.cli import _with_schema
    from tests.pg.helpers import fresh_schema

    async with fresh_schema(base_url) as schema:
        return await body(_with_schema(base_url, schema))
