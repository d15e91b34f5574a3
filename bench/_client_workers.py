"""Client processes of the SDK benchmark (`bench.client`): writers and subscribers, each a real
`WorkspaceClient` talking to the real `cv-server` process.

A writer process runs several writers, each with its **own** `WorkspaceClient` (own websocket, own
outbox file: one client per outbox), the way the peer benchmark gives each writer its own
connection. A writer keeps `window` `apply_op` calls in flight: 1 is the peer's closed loop (await
the ack, then send the next op); more is an app firing ops without waiting, which the SDK
pipelines (per sub-doc, whatever is pending travels as the next batch).

A subscriber process runs several subscriber clients; each subscribes to every measured sub-doc
through `WorkspaceClient.subscribe` and checks that clocks arrive as last + 1, hashing
(clock, op_id) so the parent can compare with what the writers were acknowledged.

Broadcast latency: the writer puts `time.time()` in the op's `meta.t` just before `apply_op`; the
subscriber subtracts it from `time.time()` when the SDK hands it the op. One machine, one clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import gc
import json
import os
import time
import traceback
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import aiohttp
import psutil  # type: ignore[import-untyped]  # no types-psutil in the dev extras

from bench._digest import digest_step, new_digest
from bench._procs import raise_nofile
from cv_mutations import NodeIncrement, new_op_id
from cv_workspace_client import (
    ClientConfig,
    Snapshot,
    Subscription,
    WorkspaceClient,
    WorkspaceError,
)

__all__ = [
    "Control",
    "SubscriberJob",
    "SubscriberResult",
    "Transport",
    "WorkerFailed",
    "WriterJob",
    "WriterResult",
    "worker_main",
]

Transport = Literal["websocket", "http", "bare"]

#: How long a client process waits for the parent's `go` or final clocks before giving up.
PHASE_TIMEOUT_S: Final = 300.0
#: How long subscribers may take, once the writers are done, to see the last ops.
DRAIN_TIMEOUT_S: Final = 60.0
#: How long getting ready (connect, warm op, subscriptions live) may take.
READY_TIMEOUT_S: Final = 60.0
#: Latency samples kept per process: bounded memory whatever the op count.
MAX_SAMPLES: Final = 1_000_000
#: Sub-doc every writer warms up on (never one that is measured).
WARM_SUB_DOC: Final = "warm"


@dataclass(frozen=True, slots=True)
class WriterJob:
    """Writers `writers` = ((global index, sub_doc), ...), `ops_per_writer` ops each."""

    name: str
    url: str
    token: str
    workspace: str
    writers: tuple[tuple[int, str], ...]
    ops_per_writer: int
    #: `apply_op` calls each writer keeps in flight (1 = await each ack before the next op).
    window: int
    #: "websocket": the SDK, ops over the workspace websocket; "http": the SDK with
    #: `ClientConfig(ops_over_websocket=False)` (every batch an HTTP POST); "bare": no SDK, raw
    #: `apply` frames on an aiohttp websocket, each awaiting its ack (the protocol's floor).
    transport: Transport
    #: Directory for the writers' outbox files; None = in-memory outbox.
    outbox_dir: str | None
    #: Writers stop issuing ops after this many seconds, done or not.
    time_cap_s: float
    keep_acks: bool
    #: True: all writers of the process share one `WorkspaceClient` (one socket, one outbox).
    shared_client: bool = False
    #: Dump a cProfile of the event-loop thread here.
    profile_path: str | None = None


@dataclass(frozen=True, slots=True)
class SubscriberJob:
    """`subscribers` clients (global indexes `first`...), each subscribed to every sub-doc."""

    name: str
    url: str
    token: str
    workspace: str
    subscribers: int
    first: int
    sub_docs: tuple[str, ...]
    profile_path: str | None = None


@dataclass(slots=True)
class WriterResult:
    name: str
    ops: int = 0
    duplicates: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0
    #: Process CPU over the writing window: the event-loop thread, and the others (outbox files).
    cpu_main_s: float = 0.0
    cpu_other_s: float = 0.0
    ack_ms: array[float] = field(default_factory=lambda: array("d"))
    #: (sub_doc, clock, op_id) of every acknowledged op, when the job asks for them.
    acks: list[tuple[str, int, str]] = field(default_factory=list)
    #: (writer index, sub_doc, ops acknowledged): the counter each writer's ops built.
    counters: list[tuple[int, str, int]] = field(default_factory=list)


@dataclass(slots=True)
class SubscriberResult:
    name: str
    deliveries: int = 0
    #: Ops whose clock was not last + 1 (a duplicate, a reordering or a gap).
    violations: int = 0
    error_samples: list[str] = field(default_factory=list)
    cpu_main_s: float = 0.0
    cpu_other_s: float = 0.0
    broadcast_ms: array[float] = field(default_factory=lambda: array("d"))
    #: (subscriber index, sub_doc) → (last clock, digest of (clock, op_id) in order, count).
    seen: dict[tuple[int, str], tuple[int, str, int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class WorkerFailed:
    name: str
    error: str


@dataclass(frozen=True, slots=True)
class Control:
    """Multiprocessing handles (typed loosely: context-bound proxies)."""

    go: Any  # Event
    ready: Any  # Queue of names
    results: Any  # Queue of WriterResult | SubscriberResult | WorkerFailed
    inbox: Any  # per subscriber process: {sub_doc: final clock}, or None to give up


def worker_main(job: WriterJob | SubscriberJob, control: Control) -> None:
    """Process entry point (spawned): run `job`, put exactly one result on `control.results`."""
    raise_nofile()
    try:
        result: WriterResult | SubscriberResult
        if isinstance(job, WriterJob):
            result = asyncio.run(_run_writers(job, control))
        else:
            result = asyncio.run(_run_subscribers(job, control))
        control.results.put(result)
    except BaseException:
        control.results.put(WorkerFailed(job.name, traceback.format_exc()))


async def _wait(control_call: Any, *args: Any) -> Any:
    """Run a blocking multiprocessing call off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, control_call, *args)


def _thread_cpu() -> tuple[float, float]:
    """(event-loop thread, all other threads) CPU seconds of this process so far."""
    process = psutil.Process()
    main = other = 0.0
    for thread in process.threads():
        spent = thread.user_time + thread.system_time
        if thread.id == process.pid:
            main += spent
        else:
            other += spent
    return main, other


class _Profile:
    """cProfile of the event-loop thread over the measured window only (CPU time, not wall)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.profile = cProfile.Profile(time.thread_time) if path else None

    def __enter__(self) -> None:
        if self.profile is not None:
            self.profile.enable()

    def __exit__(self, *exc: object) -> None:
        if self.profile is not None and self.path is not None:
            self.profile.disable()
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self.profile.dump_stats(self.path)


# -- writers ---------------------------------------------------------------------------------------


async def _run_writers(job: WriterJob, control: Control) -> WriterResult:
    if job.transport == "bare":
        return await _run_bare(job, control)
    result = WriterResult(job.name)
    config = ClientConfig(ops_over_websocket=job.transport == "websocket")
    async with contextlib.AsyncExitStack() as stack:
        clients: list[WorkspaceClient] = []
        for n, (index, _) in enumerate(job.writers):
            if job.shared_client and n:
                clients.append(clients[0])
                continue
            outbox = None
            if job.outbox_dir is not None:
                outbox = os.path.join(job.outbox_dir, f"{job.name}-w{index}.outbox.db")
            client = WorkspaceClient(job.url, token=job.token, outbox=outbox, config=config)
            clients.append(await stack.enter_async_context(client))

        async def warm(client: WorkspaceClient, index: int) -> None:
            if job.transport == "websocket":
                await client.connect(job.workspace, timeout=READY_TIMEOUT_S)
            # One op each off the measured sub-docs: the outbox file, the session and the
            # server's code paths are warm before the clock starts.
            await client.apply_op(job.workspace, WARM_SUB_DOC, _op(index, 0.0))

        async with asyncio.timeout(READY_TIMEOUT_S):
            await asyncio.gather(
                *(warm(c, index) for c, (index, _) in zip(clients, job.writers, strict=True))
            )
        await _ready_and_go(job, control)
        cpu0 = _thread_cpu()
        result.started = time.time()
        deadline = result.started + job.time_cap_s
        with _Profile(job.profile_path):
            await asyncio.gather(
                *(
                    _writer(job, client, index, sub_doc, result, deadline)
                    for client, (index, sub_doc) in zip(clients, job.writers, strict=True)
                )
            )
        result.ended = time.time()
        _cpu_since(result, cpu0)
    return result


async def _ready_and_go(job: WriterJob | SubscriberJob, control: Control) -> None:
    gc.collect()
    gc.freeze()  # long-lived client objects: keep full collections out of the latencies
    control.ready.put(job.name)
    if not await _wait(control.go.wait, PHASE_TIMEOUT_S):
        raise TimeoutError("the parent never said go")


def _cpu_since(result: WriterResult | SubscriberResult, cpu0: tuple[float, float]) -> None:
    cpu1 = _thread_cpu()
    result.cpu_main_s = cpu1[0] - cpu0[0]
    result.cpu_other_s = cpu1[1] - cpu0[1]


def _op(index: int, sent: float) -> NodeIncrement:
    # The peer's op sets the writer's own key; ours increments the writer's own counter, so a
    # double apply would show in the final state.
    return NodeIncrement(node_id="root", field=f"w{index}", by=1, meta={"t": sent})


async def _writer(
    job: WriterJob,
    client: WorkspaceClient,
    index: int,
    sub_doc: str,
    result: WriterResult,
    deadline: float,
) -> None:
    issued = 0
    acked = 0

    async def one_slot() -> None:
        nonlocal issued, acked
        while issued < job.ops_per_writer and time.time() < deadline:
            issued += 1
            sent = time.time()
            began = time.perf_counter()
            try:
                commit = await client.apply_op(job.workspace, sub_doc, _op(index, sent))
            except WorkspaceError as exc:
                result.errors += 1
                if len(result.error_samples) < 5:
                    result.error_samples.append(f"{type(exc).__name__}: {exc}")
                continue
            if len(result.ack_ms) < MAX_SAMPLES:
                result.ack_ms.append((time.perf_counter() - began) * 1000)
            acked += 1
            result.ops += 1
            if commit.duplicate:
                result.duplicates += 1
            if job.keep_acks:
                result.acks.append((sub_doc, commit.clock, commit.op_id))

    await asyncio.gather(*(one_slot() for _ in range(job.window)))
    result.counters.append((index, sub_doc, acked))


# -- bare websocket (no SDK) -----------------------------------------------------------------------


async def _run_bare(job: WriterJob, control: Control) -> WriterResult:
    """The floor under the SDK: each writer sends `apply` frames itself and awaits each ack."""
    result = WriterResult(job.name)
    url = f"{job.url}/v1/workspaces/{job.workspace}/socket"
    headers = {"Authorization": f"Bearer {job.token}"}
    async with aiohttp.ClientSession() as session:
        sockets = [await session.ws_connect(url, headers=headers) for _ in job.writers]
        for ws, (index, _) in zip(sockets, job.writers, strict=True):
            await _bare_apply(ws, WARM_SUB_DOC, index, 0.0)
        await _ready_and_go(job, control)
        cpu0 = _thread_cpu()
        result.started = time.time()
        deadline = result.started + job.time_cap_s

        async def writer(ws: aiohttp.ClientWebSocketResponse, index: int, sub_doc: str) -> None:
            acked = 0
            for _ in range(job.ops_per_writer):
                if time.time() >= deadline:
                    break
                began = time.perf_counter()
                answer = await _bare_apply(ws, sub_doc, index, time.time())
                outcome = answer["results"][0]
                if "clock" not in outcome:
                    result.errors += 1
                    if len(result.error_samples) < 5:
                        result.error_samples.append(str(outcome)[:200])
                    continue
                if len(result.ack_ms) < MAX_SAMPLES:
                    result.ack_ms.append((time.perf_counter() - began) * 1000)
                acked += 1
                result.ops += 1
                result.duplicates += bool(outcome.get("duplicate"))
                if job.keep_acks:
                    result.acks.append((sub_doc, outcome["clock"], outcome["op_id"]))
            result.counters.append((index, sub_doc, acked))

        with _Profile(job.profile_path):
            await asyncio.gather(
                *(
                    writer(ws, index, sub_doc)
                    for ws, (index, sub_doc) in zip(sockets, job.writers, strict=True)
                )
            )
        result.ended = time.time()
        _cpu_since(result, cpu0)
        for ws in sockets:
            await ws.close()
    return result


async def _bare_apply(
    ws: aiohttp.ClientWebSocketResponse, sub_doc: str, index: int, sent: float
) -> Any:
    op = {
        "type": "node.increment",
        "op_id": new_op_id(),
        "node_id": "root",
        "field": f"w{index}",
        "by": 1,
        "meta": {"t": sent},
    }
    await ws.send_str(json.dumps({"type": "apply", "sub_doc": sub_doc, "ops": [op], "req": 1}))
    while True:
        frame = json.loads(await ws.receive_str())
        if frame.get("type") == "ack":
            return frame
        if frame.get("type") == "error":
            raise RuntimeError(f"apply refused: {frame}")


# -- subscribers -----------------------------------------------------------------------------------


class _Watch:
    """One subscription's view of one sub-doc."""

    __slots__ = ("count", "digest", "last", "live", "reached")

    def __init__(self) -> None:
        self.last = 0
        self.count = 0
        self.digest = new_digest()
        #: Set once the warm op (clock 1) arrived: the subscription is live on the server.
        self.live = asyncio.Event()
        #: Set once the final clock arrived (after the parent told us what it is).
        self.reached = asyncio.Event()


async def _run_subscribers(job: SubscriberJob, control: Control) -> SubscriberResult:
    result = SubscriberResult(job.name)
    finals: dict[str, int] = {}
    async with contextlib.AsyncExitStack() as stack:
        watches: dict[tuple[int, str], _Watch] = {}
        readers: list[asyncio.Task[None]] = []
        for i in range(job.subscribers):
            index = job.first + i
            client = await stack.enter_async_context(
                WorkspaceClient(job.url, token=job.token, outbox=None)
            )
            for sub_doc in job.sub_docs:
                watch = watches[(index, sub_doc)] = _Watch()
                sub = await stack.enter_async_context(client.subscribe(job.workspace, sub_doc))
                readers.append(asyncio.create_task(_read(sub, watch, result, finals)))
        # The parent committed one warm op per sub-doc before starting us: seeing it proves the
        # server streams the sub-doc to this subscription.
        async with asyncio.timeout(READY_TIMEOUT_S):
            await asyncio.gather(*(w.live.wait() for w in watches.values()))
        await _ready_and_go(job, control)
        cpu0 = _thread_cpu()
        with _Profile(job.profile_path):
            told: dict[str, int] | None = await _wait(control.inbox.get, True, PHASE_TIMEOUT_S)
            if told is not None:
                finals.update(told)
                for (_, sub_doc), watch in watches.items():
                    if watch.last >= finals.get(sub_doc, 0):
                        watch.reached.set()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(DRAIN_TIMEOUT_S):
                        await asyncio.gather(*(w.reached.wait() for w in watches.values()))
        _cpu_since(result, cpu0)
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        for key, watch in watches.items():
            result.seen[key] = (watch.last, watch.digest.hexdigest(), watch.count)
    return result


async def _read(
    sub: Subscription, watch: _Watch, result: SubscriberResult, finals: dict[str, int]
) -> None:
    latencies = result.broadcast_ms
    try:
        async for committed in sub:
            if isinstance(committed, Snapshot):  # the bench never compacts
                continue
            now = time.time()
            result.deliveries += 1
            watch.count += 1
            if committed.clock != watch.last + 1:
                result.violations += 1
                if len(result.error_samples) < 5:
                    result.error_samples.append(
                        f"{sub.sub_doc}: clock {committed.clock} after {watch.last}"
                    )
            watch.last = max(watch.last, committed.clock)
            digest_step(watch.digest, committed.clock, committed.op_id)
            meta = committed.op.meta
            sent = meta.get("t") if meta else None
            if isinstance(sent, float) and sent > 0 and len(latencies) < MAX_SAMPLES:
                latencies.append((now - sent) * 1000)
            watch.live.set()
            final = finals.get(sub.sub_doc)
            if final is not None and watch.last >= final:
                watch.reached.set()
    except WorkspaceError as exc:
        if len(result.error_samples) < 5:
            result.error_samples.append(f"{sub.sub_doc}: {type(exc).__name__}: {exc}")
