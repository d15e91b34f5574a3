"""Client processes of the op-log benchmark: writers (HTTP or websocket) and subscribers.

Each client process runs many asyncio connections (aiohttp) and talks to its parent through
multiprocessing queues: it reports `ready` once its connections are open (and, for subscribers,
synced), waits for the shared `go` event, does its work, and sends one result back. Subscribers
also wait for the parent to tell them the final clock of every sub-doc, so "every op exactly once,
in order" is checked against what the writers were actually acknowledged, not against a guess.

Broadcast latency: a writer puts `time.time()` in the op's `meta.t` just before sending; a
subscriber subtracts it from `time.time()` when the `op` frame arrives. Every process is on the
same machine, so the wall clocks agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import secrets
import time
import traceback
from array import array
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import aiohttp

from bench._digest import digest_step, new_digest
from bench._procs import raise_nofile

__all__ = [
    "Control",
    "SubscriberResult",
    "SubscriberSpec",
    "Target",
    "Transport",
    "WorkerFailed",
    "WriterResult",
    "WriterSpec",
    "worker_main",
]

Transport = Literal["aiohttp", "raw", "socket"]

#: How long a client process waits for the parent's `go` or final clocks before giving up.
PHASE_TIMEOUT_S: Final = 300.0
#: How long subscribers wait, after the writers are done, for the last op frames to arrive.
DRAIN_TIMEOUT_S: Final = 30.0
#: Websocket handshakes in flight per process: the server's listen backlog is aiohttp's default
#: (128), and a connect storm beyond it turns into SYN retries that measure the kernel, not us.
CONNECT_CONCURRENCY: Final = 24
CONNECT_ATTEMPTS: Final = 5
#: Ack latencies kept per process are capped so a long run cannot exhaust memory.
MAX_SAMPLES: Final = 2_000_000


@dataclass(frozen=True, slots=True)
class Target:
    url: str
    token: str
    workspace: str


@dataclass(frozen=True, slots=True)
class WriterSpec:
    """`writers` concurrent writers; writer i (global index `first + i`) writes to
    `sub_docs[(first + i) % len(sub_docs)]`, `batch` ops per HTTP request, awaiting each answer
    before the next request. `rate` (ops/s per writer) paces them open-loop; None = flat out."""

    name: str
    target: Target
    sub_docs: tuple[str, ...]
    writers: int
    first: int
    batch: int
    duration_s: float
    max_requests: int
    rate: float | None
    keep_acks: bool
    warm_sub_doc: str
    #: "aiohttp" (HTTP POST, ClientSession), "raw" (HTTP POST, bare HTTP/1.1 on asyncio streams:
    #: less client CPU) or "socket" (websocket `apply` frames).
    transport: Transport = "aiohttp"


@dataclass(frozen=True, slots=True)
class SubscriberSpec:
    """`connections` websockets; connection i (global `first + i`) subscribes (since 0) to every
    sub-doc in `sub_docs` if `each_all`, else to `sub_docs[(first + i) % len(sub_docs)]`."""

    name: str
    target: Target
    sub_docs: tuple[str, ...]
    connections: int
    first: int
    each_all: bool


@dataclass(slots=True)
class WriterResult:
    name: str
    pid: int
    ops: int = 0
    requests: int = 0
    op_errors: int = 0
    http_errors: int = 0
    started: float = 0.0
    ended: float = 0.0
    cpu_s: float = 0.0
    per_doc: dict[str, int] = field(default_factory=dict)
    ack_ms: array[float] = field(default_factory=lambda: array("d"))
    #: (sub_doc, clock, op_id) of every committed op, when the spec asks for them.
    acks: list[tuple[str, int, str]] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)


@dataclass(slots=True)
class SubscriberResult:
    name: str
    pid: int
    connect_s: float = 0.0
    connect_failures: int = 0
    cpu_s: float = 0.0
    frames: int = 0
    #: Frames whose clock was not last + 1 (a duplicate, a reordering or a gap).
    violations: int = 0
    unexpected_closes: int = 0
    broadcast_ms: array[float] = field(default_factory=lambda: array("d"))
    #: (connection index, sub_doc) → (last clock seen in order, digest of (clock, op_id) so far).
    seen: dict[tuple[int, str], tuple[int, str]] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class WorkerFailed:
    name: str
    error: str


@dataclass(frozen=True, slots=True)
class Control:
    """The shared multiprocessing handles (typed loosely: they are context-bound proxies)."""

    go: Any  # multiprocessing Event
    ready: Any  # Queue of (name, seconds to get ready)
    results: Any  # Queue of WriterResult | SubscriberResult | WorkerFailed
    inbox: Any  # per-process Queue; subscribers receive {sub_doc: final clock} on it


def worker_main(spec: WriterSpec | SubscriberSpec, control: Control) -> None:
    """Process entry point (spawned): run one spec, put exactly one result on `results`."""
    raise_nofile()
    try:
        result: WriterResult | SubscriberResult
        if isinstance(spec, WriterSpec):
            result = asyncio.run(_run_writers(spec, control))
        else:
            result = asyncio.run(_run_subscribers(spec, control))
        control.results.put(result)
    except BaseException:
        control.results.put(WorkerFailed(spec.name, traceback.format_exc()))


async def _wait_go(control: Control) -> None:
    loop = asyncio.get_running_loop()
    if not await loop.run_in_executor(None, control.go.wait, PHASE_TIMEOUT_S):
        raise TimeoutError("the parent never said go")


# -- writers -------------------------------------------------------------------------------------


class _OpMaker:
    """Fresh op_ids without a nanoid per op: a random per-process prefix plus a counter is just
    as unique and keeps the client's CPU for sending."""

    def __init__(self) -> None:
        self.prefix = secrets.token_urlsafe(9)
        self.counter = 0

    def op(self) -> dict[str, Any]:
        self.counter += 1
        return {
            "type": "node.increment",
            "op_id": f"{self.prefix}{self.counter:x}",
            "node_id": "root",
            "field": "n",
            "by": 1,
            "meta": {"t": 0.0},
        }


class _Poster:
    """Sends op batches for one writer and returns (HTTP-like status, `{"results": [...]}`);
    `aclose()` when done."""

    async def post(self, sub_doc: str, ops: list[dict[str, Any]]) -> tuple[int, Any]:
        raise NotImplementedError

    async def aclose(self) -> None:
        return None


def _body(ops: list[dict[str, Any]]) -> bytes:
    return json.dumps({"ops": ops}, separators=(",", ":")).encode()


class _AiohttpPoster(_Poster):
    """Through a shared `aiohttp.ClientSession` (keep-alive pool): what an SDK would do."""

    def __init__(self, session: aiohttp.ClientSession, target: Target) -> None:
        self.session = session
        self.base = f"{target.url}/v1/workspaces/{target.workspace}/docs/"
        self.headers = {
            "Authorization": f"Bearer {target.token}",
            "Content-Type": "application/json",
        }

    async def post(self, sub_doc: str, ops: list[dict[str, Any]]) -> tuple[int, Any]:
        url = f"{self.base}{sub_doc}/ops"
        async with self.session.post(url, data=_body(ops), headers=self.headers) as r:
            return r.status, json.loads(await r.read())


class _RawPoster(_Poster):
    """Bare HTTP/1.1 keep-alive over one asyncio stream: a fraction of aiohttp's client CPU, so
    on a 2-core machine more of it is left to the server being measured. Understands exactly
    what the server sends back (a Content-Length body), nothing more."""

    def __init__(self, target: Target) -> None:
        hostport = target.url.removeprefix("http://").rstrip("/")
        host, _, port = hostport.rpartition(":")
        self.host, self.port = host, int(port)
        self.base = f"/v1/workspaces/{target.workspace}/docs/"
        self.head = (
            f"Host: {hostport}\r\nAuthorization: Bearer {target.token}\r\n"
            "Content-Type: application/json\r\n"
        )
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, sub_doc: str, ops: list[dict[str, Any]]) -> tuple[int, Any]:
        if self.writer is None or self.reader is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        body = _body(ops)
        path = f"{self.base}{sub_doc}/ops"
        request = f"POST {path} HTTP/1.1\r\n{self.head}Content-Length: {len(body)}\r\n\r\n"
        self.writer.write(request.encode() + body)
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            length = 0
            keep_alive = True
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "connection" and value.strip().lower() == "close":
                    keep_alive = False
            payload = await self.reader.readexactly(length)
        except BaseException:
            await self.aclose()
            raise
        if not keep_alive:
            await self.aclose()
        return status, json.loads(payload)

    async def aclose(self) -> None:
        writer, self.writer, self.reader = self.writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


class _SocketPoster(_Poster):
    """`apply` frames on one workspace websocket, each awaiting its `ack` (docs/protocol.md): the
    same commit pipeline without a new HTTP request per op."""

    def __init__(self, session: aiohttp.ClientSession, target: Target) -> None:
        self.session = session
        self.url = f"{target.url}/v1/workspaces/{target.workspace}/socket"
        self.headers = {"Authorization": f"Bearer {target.token}"}
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.req = 0

    async def post(self, sub_doc: str, ops: list[dict[str, Any]]) -> tuple[int, Any]:
        if self.ws is None or self.ws.closed:
            self.ws = await self.session.ws_connect(self.url, headers=self.headers)
        self.req += 1
        frame = {"type": "apply", "sub_doc": sub_doc, "ops": ops, "req": self.req}
        await self.ws.send_str(json.dumps(frame, separators=(",", ":")))
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            answer = json.loads(msg.data)
            if answer.get("req") != self.req:
                continue
            if answer.get("type") == "ack":
                return 200, answer
            return 500, answer
        raise ConnectionResetError(f"socket closed ({self.ws.close_code}) before the ack")

    async def aclose(self) -> None:
        if self.ws is not None:
            await self.ws.close()


def _poster(spec: WriterSpec, session: aiohttp.ClientSession) -> _Poster:
    if spec.transport == "socket":
        return _SocketPoster(session, spec.target)
    if spec.transport == "raw":
        return _RawPoster(spec.target)
    return _AiohttpPoster(session, spec.target)


async def _run_writers(spec: WriterSpec, control: Control) -> WriterResult:
    result = WriterResult(spec.name, os.getpid())
    maker = _OpMaker()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        posters = [_poster(spec, session) for _ in range(spec.writers)]
        # Warm-up: one request per writer opens its keep-alive connection, off the measured docs.
        await asyncio.gather(*(p.post(spec.warm_sub_doc, [maker.op()]) for p in posters))
        gc.freeze()  # as for subscribers: keep client GC pauses out of the latencies
        control.ready.put((spec.name, 0.0))
        await _wait_go(control)
        cpu0 = time.process_time()
        start = time.time()
        result.started = start
        deadline = start + spec.duration_s
        await asyncio.gather(
            *(
                _writer(spec, i, poster, maker, result, start, deadline)
                for i, poster in enumerate(posters)
            )
        )
        result.ended = time.time()
        result.cpu_s = time.process_time() - cpu0
        await asyncio.gather(*(poster.aclose() for poster in posters))
    return result


def _writer_doc(spec: WriterSpec, i: int) -> str:
    return spec.sub_docs[(spec.first + i) % len(spec.sub_docs)]


async def _writer(
    spec: WriterSpec,
    i: int,
    poster: _Poster,
    maker: _OpMaker,
    result: WriterResult,
    start: float,
    deadline: float,
) -> None:
    sub_doc = _writer_doc(spec, i)
    # Paced writers are spread over one period so their sends do not all land on the same tick.
    period = spec.batch / spec.rate if spec.rate else 0.0
    phase = period * ((spec.first + i) % 97) / 97
    for n in range(spec.max_requests):
        if spec.rate:
            due = start + phase + n * period
            if due >= deadline:
                return
            delay = due - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
        # A writer that cannot keep its pace stops at the deadline too: time stays bounded.
        if time.time() >= deadline:
            return
        ops = [maker.op() for _ in range(spec.batch)]
        sent = time.time()
        for op in ops:
            op["meta"]["t"] = sent
        began = time.perf_counter()
        try:
            status, body = await poster.post(sub_doc, ops)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            result.http_errors += 1
            if len(result.error_samples) < 5:
                result.error_samples.append(f"{type(exc).__name__}: {exc}")
            continue
        elapsed_ms = (time.perf_counter() - began) * 1000
        result.requests += 1
        if len(result.ack_ms) < MAX_SAMPLES:
            result.ack_ms.append(elapsed_ms)
        if status != 200:
            result.http_errors += 1
            if len(result.error_samples) < 5:
                result.error_samples.append(f"HTTP {status}: {str(body)[:200]}")
            continue
        for outcome in body["results"]:
            if "clock" in outcome and not outcome.get("duplicate"):
                result.ops += 1
                result.per_doc[sub_doc] = result.per_doc.get(sub_doc, 0) + 1
                if spec.keep_acks:
                    result.acks.append((sub_doc, int(outcome["clock"]), outcome["op_id"]))
            else:
                result.op_errors += 1
                if len(result.error_samples) < 5:
                    result.error_samples.append(json.dumps(outcome)[:200])


# -- subscribers ---------------------------------------------------------------------------------


class _Watch:
    """One connection's view of one sub-doc."""

    __slots__ = ("digest", "done", "last", "synced")

    def __init__(self) -> None:
        self.last = 0
        self.digest = new_digest()
        self.synced = asyncio.Event()
        self.done = False


class _Conn:
    __slots__ = ("closed_by_us", "index", "watches", "ws")

    def __init__(self, index: int, sub_docs: list[str]) -> None:
        self.index = index
        self.watches = {sub_doc: _Watch() for sub_doc in sub_docs}
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.closed_by_us = False


class _Finish:
    """Counts the watches that have not yet reached their sub-doc's final clock, so the drain
    phase waits on one event instead of rescanning 10,000 connections per frame."""

    def __init__(self) -> None:
        self.finals: dict[str, int] | None = None
        self.pending = 0
        self.all_done = asyncio.Event()

    def start(self, conns: list[_Conn], finals: dict[str, int]) -> None:
        self.finals = finals
        for conn in conns:
            for sub_doc, watch in conn.watches.items():
                if watch.last >= finals.get(sub_doc, 0) or (conn.ws is None or conn.ws.closed):
                    watch.done = True
                else:
                    self.pending += 1
        if self.pending == 0:
            self.all_done.set()

    def advanced(self, sub_doc: str, watch: _Watch, gave_up: bool = False) -> None:
        if self.finals is None or watch.done:
            return
        if gave_up or watch.last >= self.finals.get(sub_doc, 0):
            watch.done = True
            self.pending -= 1
            if self.pending == 0:
                self.all_done.set()


async def _run_subscribers(spec: SubscriberSpec, control: Control) -> SubscriberResult:
    result = SubscriberResult(spec.name, os.getpid())
    target = spec.target
    url = f"{target.url}/v1/workspaces/{target.workspace}/socket"
    conns = [
        _Conn(
            spec.first + i,
            list(spec.sub_docs)
            if spec.each_all
            else [spec.sub_docs[(spec.first + i) % len(spec.sub_docs)]],
        )
        for i in range(spec.connections)
    ]
    finish = _Finish()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        gate = asyncio.Semaphore(CONNECT_CONCURRENCY)
        began = time.perf_counter()
        readers = await asyncio.gather(
            *(_open(session, url, target.token, conn, gate, result, finish) for conn in conns)
        )
        result.connect_s = time.perf_counter() - began
        result.connect_failures = sum(1 for reader in readers if reader is None)
        # Thousands of long-lived connection objects would make every full collection in this
        # process a pause that shows up as broadcast latency; the server is what is measured.
        gc.freeze()
        control.ready.put((spec.name, result.connect_s))
        await _wait_go(control)
        cpu0 = time.process_time()
        loop = asyncio.get_running_loop()
        finals: dict[str, int] | None = await loop.run_in_executor(
            None, control.inbox.get, True, PHASE_TIMEOUT_S
        )
        # The finals arrive when the writers are done: the CPU of the writing window.
        result.cpu_s = time.process_time() - cpu0
        if finals is not None:
            finish.start(conns, finals)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(finish.all_done.wait(), timeout=DRAIN_TIMEOUT_S)
        for conn in conns:
            conn.closed_by_us = True
        await asyncio.gather(*(conn.ws.close() for conn in conns if conn.ws is not None))
        await asyncio.gather(*(r for r in readers if r is not None), return_exceptions=True)
    for conn in conns:
        for sub_doc, watch in conn.watches.items():
            result.seen[(conn.index, sub_doc)] = (watch.last, watch.digest.hexdigest())
    return result


async def _open(
    session: aiohttp.ClientSession,
    url: str,
    token: str,
    conn: _Conn,
    gate: asyncio.Semaphore,
    result: SubscriberResult,
    finish: _Finish,
) -> asyncio.Task[None] | None:
    """Connect and subscribe; None (counted as a connect failure) if the server never let us."""
    async with gate:
        for attempt in range(CONNECT_ATTEMPTS):
            try:
                conn.ws = await session.ws_connect(
                    url,
                    headers={"Authorization": f"Bearer {token}"},
                    autoping=True,
                    max_msg_size=4 * 1024 * 1024,
                )
                break
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                if attempt == CONNECT_ATTEMPTS - 1:
                    if len(result.error_samples) < 5:
                        result.error_samples.append(f"connect: {type(exc).__name__}: {exc}")
                    return None
                await asyncio.sleep(0.2 * (attempt + 1))
        assert conn.ws is not None
        reader = asyncio.create_task(_read(conn, result, finish))
        for sub_doc in conn.watches:
            await conn.ws.send_str(
                json.dumps({"type": "subscribe", "sub_doc": sub_doc, "since": 0})
            )
        for watch in conn.watches.values():
            await asyncio.wait_for(watch.synced.wait(), timeout=60)
    return reader


async def _read(conn: _Conn, result: SubscriberResult, finish: _Finish) -> None:
    ws = conn.ws
    assert ws is not None
    latencies = result.broadcast_ms
    async for msg in ws:
        if msg.type != aiohttp.WSMsgType.TEXT:
            continue
        now = time.time()
        frame = json.loads(msg.data)
        kind = frame.get("type")
        if kind == "op":
            result.frames += 1
            sub_doc = frame["sub_doc"]
            watch = conn.watches.get(sub_doc)
            if watch is None:
                result.violations += 1
                continue
            clock = frame["clock"]
            if clock == watch.last + 1:
                watch.last = clock
                digest_step(watch.digest, clock, frame["op_id"])
            else:
                result.violations += 1
                if len(result.error_samples) < 5:
                    result.error_samples.append(
                        f"conn {conn.index} {sub_doc}: clock {clock} after {watch.last}"
                    )
                watch.last = max(watch.last, clock)
            meta = frame["op"].get("meta") or {}
            if "t" in meta and len(latencies) < MAX_SAMPLES:
                latencies.append((now - meta["t"]) * 1000)
            finish.advanced(sub_doc, watch)
        elif kind == "synced":
            watch = conn.watches.get(frame["sub_doc"])
            if watch is not None:
                watch.synced.set()
        elif kind == "error" and len(result.error_samples) < 5:
            result.error_samples.append(f"conn {conn.index}: {msg.data[:200]}")
    if not conn.closed_by_us:
        result.unexpected_closes += 1
        if len(result.error_samples) < 5:
            result.error_samples.append(f"conn {conn.index} closed by server: {ws.close_code}")
        for sub_doc, watch in conn.watches.items():
            watch.synced.set()  # do not leave _open waiting on a dead socket
            finish.advanced(sub_doc, watch, gave_up=True)
