"""The live feed's server side (docs/concepts.md, docs/protocol.md): many sub-docs catching up on
one socket, re-subscribing mid catch-up, applies and subscribes mixed in one batched message, random
interleavings checked against the log."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientWebSocketResponse, WSMsgType
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cv_server import ServerConfig, create_app
from cv_server.cli import _with_schema
from tests.pg.helpers import fresh_schema
from tests.server.conftest import SECRET, ClientFactory, auth
from tests.server.helpers import get_ops, insert, post_ops

SOCKET = "/v1/workspaces/ws1/socket"


def _padded(node_id: str, pad: str) -> dict[str, Any]:
    return {"type": "node.insert", "node_id": node_id, "parent_id": "root", "fields": {"p": pad}}


async def _frames(ws: ClientWebSocketResponse) -> list[dict[str, Any]]:
    message = await ws.receive()
    assert message.type == WSMsgType.TEXT, message
    body = message.json()
    return body if isinstance(body, list) else [body]


# -- several catch-ups sharing one connection's queue ----------------------------------------


async def test_many_sub_docs_catching_up_at_once_on_one_socket_are_not_cut_off(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    client = await aiohttp_client(
        create_app(make_config(subscriber_queue_limit=40, catchup_page=20))
    )
    sub_docs = [f"d{k}" for k in range(6)]
    per_doc = 60
    for sub_doc in sub_docs:
        for start in range(0, per_doc, 20):
            # Big ops fill the kernel's socket buffers, so the server's own queue is what grows.
            ops = [_padded(f"n{i}", "x" * 20_000) for i in range(start, start + 20)]
            await post_ops(client, ops, sub_doc=sub_doc)
    ws = await client.ws_connect(SOCKET, headers=auth("ws1"))
    # One message: every catch-up starts from the same empty queue.
    await ws.send_json([{"type": "subscribe", "sub_doc": d, "since": 0} for d in sub_docs])
    clocks: dict[str, list[int]] = {d: [] for d in sub_docs}
    synced: set[str] = set()
    async with asyncio.timeout(60):
        while len(synced) < len(sub_docs):
            message = await ws.receive()
            # Each catch-up alone keeps to the limit; together they must too: the reader is
            # healthy, and a 4008 here comes back at every reconnect.
            assert message.type == WSMsgType.TEXT, (message, {d: len(c) for d, c in clocks.items()})
            frame = message.json()
            if frame["type"] == "synced":
                synced.add(frame["sub_doc"])
            else:
                assert frame["type"] == "op", frame
                clocks[frame["sub_doc"]].append(frame["clock"])
    for sub_doc in sub_docs:
        assert clocks[sub_doc] == list(range(1, per_doc + 1))
    await ws.close()


async def test_a_subscriber_catching_up_while_commits_land_is_not_cut_off_for_ops_it_has(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    client = await aiohttp_client(
        create_app(make_config(subscriber_queue_limit=40, catchup_page=20))
    )
    backlog = 600
    for start in range(0, backlog, 20):
        # Big ops fill the kernel's socket buffers: catch-up goes at the pace the client reads.
        ops = [_padded(f"n{i}", "x" * 20_000) for i in range(start, start + 20)]
        await post_ops(client, ops)
    ws = await client.ws_connect(SOCKET, headers=auth("ws1"))
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
    clocks: list[int] = []
    async with asyncio.timeout(60):
        while True:
            message = await ws.receive()
            assert message.type == WSMsgType.TEXT, (message, len(clocks))
            frame = message.json()
            if frame["type"] == "synced":
                break
            clocks.append(frame["clock"])
            # A client that writes as it reads: one commit per op read, so hundreds land
            # during its catch-up, each also offered to it live, yet it is never more than a
            # page behind what catch-up reads from the log. It is not too slow.
            await post_ops(client, [insert(f"w{len(clocks)}")])
    assert clocks == list(range(1, frame["clock"] + 1))
    assert frame["clock"] > backlog + 40  # more commits came during catch-up than the limit
    await ws.close()


# -- applies in flight on one socket ---------------------------------------------------------


async def test_one_socket_cannot_queue_unbounded_applies_ahead_of_their_commits(
    aiohttp_client: ClientFactory, make_server_config: Callable[..., ServerConfig]
) -> None:
    limit = 20
    client = await aiohttp_client(create_app(make_server_config(subscriber_queue_limit=limit)))
    ws = await client.ws_connect(SOCKET, headers=auth("ws1"))
    await ws.send_json({"type": "apply", "sub_doc": "tree", "req": 0, "ops": [insert("n")]})
    assert (await ws.receive_json(timeout=10))["type"] == "ack"
    sent = 2000
    for req in range(1, sent + 1):
        op = {"type": "node.increment", "node_id": "n", "field": "c", "by": 1}
        await ws.send_json({"type": "apply", "sub_doc": "tree", "req": req, "ops": [op]})
    # Answered in the order handled: the acks before it are the applies that had committed
    # when the server read this frame; every other one sent was still held by the server.
    await ws.send_json({"type": "barrier", "sub_doc": "tree", "req": "barrier"})
    acked = 0
    async with asyncio.timeout(60):
        while (frame := await ws.receive_json())["type"] == "ack":
            acked += 1
    assert frame["req"] == "barrier"
    # The commits, not the peer, set the pace: a socket may hold a bounded number of applies
    # in flight (here at most half its queue limit), else its memory is unbounded.
    assert sent - acked <= limit // 2
    async with asyncio.timeout(60):
        while acked < sent:
            assert (await ws.receive_json())["type"] == "ack"
            acked += 1
    await ws.close()


# -- random programs against a real server ---------------------------------------------------
#
# A program is a list of steps on one socket (subscribe, unsubscribe, apply, an apply and a
# subscribe in one message, bad frames, a reconnect) and commits from elsewhere over HTTP that
# run concurrently with what follows. Each socket message starts with a barrier frame whose
# `error` answer marks, in the stream, the point the message began to be handled: every frame
# before it belongs to the subscriptions in force before the message, every frame after it to
# those after. So each received op is attributed to one subscription ("epoch"), and every epoch
# must see the clocks since+1, since+2, ... once each, in order, and reach the head if it lasts.

DOCS = ["a", "b", "c"]
SINCE = st.sampled_from(["zero", "head", "head-1", "mid", "past"])
STEP = st.one_of(
    st.tuples(st.just("sub"), st.sampled_from(DOCS), SINCE),
    st.tuples(st.just("unsub"), st.sampled_from(DOCS)),
    st.tuples(st.just("apply"), st.sampled_from(DOCS), st.integers(1, 3)),
    st.tuples(st.just("http"), st.sampled_from(DOCS), st.integers(1, 3)),
    st.tuples(st.just("apply_sub"), st.sampled_from(DOCS), SINCE, st.booleans()),
    st.tuples(st.just("bad"), st.sampled_from(["type", "sub_doc", "since", "ops", "json"])),
    st.tuples(st.just("reconnect"), st.booleans()),
    st.tuples(st.just("resub"), st.sampled_from(DOCS), SINCE),
    st.tuples(st.just("double"), st.sampled_from(DOCS), SINCE, SINCE),
)


@dataclass
class Epoch:
    sub_doc: str
    since: int
    may_be_refused: bool
    clocks: list[int] = field(default_factory=list)
    synced: int | None = None
    refused: bool = False
    ended: bool = False


class Program:
    def __init__(
        self, client: TestClient[Any, Any], elsewhere: TestClient[Any, Any] | None = None
    ) -> None:
        self.client = client
        # Where commits "from other connections" go: another instance on PostgreSQL.
        self.elsewhere = elsewhere or client
        # On one SQLite instance an ack leaves after its broadcast. On PostgreSQL the commit's
        # own NOTIFY can beat the local publish (past pg/stores.py's grace) and send a live
        # subscriber to the log: the op then comes once, in order, but after its ack.
        self.acks_follow_broadcasts = elsewhere is None
        self.ws: ClientWebSocketResponse | None = None
        self.unread: deque[dict[str, Any]] = deque()
        self.barrier = 0
        self.sent = dict.fromkeys(DOCS, 0)  # ops sent per sub-doc (all inserts: none rejected)
        self.acked = dict.fromkeys(DOCS, 0)  # ops known committed (acks, HTTP answers)
        self.current: dict[str, Epoch] = {}
        self.epochs: list[Epoch] = []
        self.http: list[asyncio.Task[Any]] = []
        self.node = 0

    def ops(self, sub_doc: str, n: int) -> list[dict[str, Any]]:
        self.sent[sub_doc] += n
        self.node += n
        return [insert(f"n{self.node - i}") for i in range(n)]

    def since(self, sub_doc: str, mode: str) -> int:
        head = self.acked[sub_doc]
        return {"zero": 0, "head": head, "head-1": max(0, head - 1), "mid": head // 2}.get(
            mode, head + 1
        )

    async def connect(self, batch: bool) -> None:
        url = SOCKET + ("?batch=1" if batch else "")
        self.ws = await self.client.ws_connect(url, headers=auth("ws1"))

    async def send(self, frames: list[Any], changes: list[tuple[str, Epoch | None]]) -> None:
        """Send a barrier then `frames` in one message; read up to the barrier's answer under
        the old epochs, then switch to the new ones."""
        assert self.ws is not None
        self.barrier += 1
        await self.ws.send_json([{"type": "barrier", "sub_doc": "x", "req": self.barrier}, *frames])
        await self.read_until(lambda f: f.get("req") == self.barrier and f["type"] == "error")
        for sub_doc, epoch in changes:
            old = self.current.pop(sub_doc, None)
            if old is not None:
                old.ended = True
            if epoch is not None:
                self.current[sub_doc] = epoch
                self.epochs.append(epoch)

    async def read_until(self, done: Callable[[dict[str, Any]], bool]) -> None:
        assert self.ws is not None
        async with asyncio.timeout(20):
            while True:
                if not self.unread:  # frames of a batched message after the last `done` one
                    self.unread.extend(await _frames(self.ws))
                frame = self.unread.popleft()
                self.receive(frame)
                if done(frame):
                    return

    def receive(self, frame: dict[str, Any]) -> None:
        kind = frame["type"]
        epoch = self.current.get(frame.get("sub_doc", ""))
        if kind == "op":
            assert epoch is not None, frame
            assert not epoch.refused, frame
            epoch.clocks.append(frame["clock"])
            expected = list(range(epoch.since + 1, epoch.since + 1 + len(epoch.clocks)))
            assert epoch.clocks == expected, (epoch, frame)
        elif kind == "synced":
            assert epoch is not None, frame
            assert epoch.synced is None, (epoch, frame)
            epoch.synced = frame["clock"]
            assert frame["clock"] == (epoch.clocks[-1] if epoch.clocks else epoch.since)
        elif kind == "ack":
            sub_doc, clocks = frame["req"].split(":")[0], []
            epoch = self.current.get(sub_doc)  # an ack names no sub-doc: its req does
            for result in frame["results"]:
                assert "error" not in result, frame
                clocks.append(result["clock"])
                self.acked[sub_doc] = max(self.acked[sub_doc], result["clock"])
            # Acked after its broadcast: a subscription already live has the op by now.
            if self.acks_follow_broadcasts and epoch is not None and epoch.synced is not None:
                assert set(clocks) <= set(epoch.clocks) | set(range(epoch.since + 1)), (
                    epoch,
                    frame,
                )
        elif kind == "error" and frame["code"] == "invalid_field" and "req" not in frame:
            assert epoch is not None, frame
            assert epoch.may_be_refused, (epoch, frame)
            assert not epoch.clocks, (epoch, frame)
            epoch.refused = True
        else:
            assert kind == "error", frame
            assert "req" in frame or frame["code"] == "malformed_json", frame

    async def post(self, sub_doc: str, ops: list[dict[str, Any]]) -> None:
        body = await post_ops(self.elsewhere, ops, sub_doc=sub_doc)
        for result in body["results"]:
            self.acked[sub_doc] = max(self.acked[sub_doc], result["clock"])

    def subscribe(self, sub_doc: str, mode: str) -> tuple[dict[str, Any], Epoch]:
        since = self.since(sub_doc, mode)
        epoch = Epoch(sub_doc, since, may_be_refused=mode == "past")
        return {"type": "subscribe", "sub_doc": sub_doc, "since": since}, epoch

    def apply(self, sub_doc: str, n: int) -> dict[str, Any]:
        self.barrier += 1
        req = f"{sub_doc}:{self.barrier}"
        return {"type": "apply", "sub_doc": sub_doc, "req": req, "ops": self.ops(sub_doc, n)}

    async def step(self, step: tuple[Any, ...]) -> None:
        kind = step[0]
        if kind == "sub":
            frame, epoch = self.subscribe(step[1], step[2])
            await self.send([frame], [(step[1], epoch)])
        elif kind == "unsub":
            await self.send([{"type": "unsubscribe", "sub_doc": step[1]}], [(step[1], None)])
        elif kind == "apply":
            await self.send([self.apply(step[1], step[2])], [])
        elif kind == "http":
            ops = self.ops(step[1], step[2])
            self.http.append(asyncio.create_task(self.post(step[1], ops)))
        elif kind == "apply_sub":
            frame, epoch = self.subscribe(step[1], step[2])
            apply = self.apply(step[1], 1)
            await self.send([apply, frame] if step[3] else [frame, apply], [(step[1], epoch)])
        elif kind == "resub":
            frame, epoch = self.subscribe(step[1], step[2])
            await self.send(
                [{"type": "unsubscribe", "sub_doc": step[1]}, frame], [(step[1], epoch)]
            )
        elif kind == "double":
            # The first is replaced before its task ever ran: only the second may send.
            first, _ = self.subscribe(step[1], step[2])
            frame, epoch = self.subscribe(step[1], step[3])
            await self.send([first, frame], [(step[1], epoch)])
        elif kind == "bad":
            bad = {
                "type": {"type": "nope", "sub_doc": "a"},
                "sub_doc": {"type": "subscribe", "sub_doc": "UPPER"},
                "since": {"type": "subscribe", "sub_doc": "a", "since": -1},
                "ops": {"type": "apply", "sub_doc": "a", "ops": [{"type": "node.nope"}]},
                "json": 7,
            }[step[1]]
            if isinstance(bad, dict):
                bad["req"] = "bad"  # else a bad `since` would read as a refused subscription
            await self.send([bad], [])
        else:
            assert self.ws is not None
            await self.ws.close()
            self.unread.clear()
            for epoch in self.current.values():
                epoch.ended = True
            self.current.clear()
            await self.connect(step[1])

    async def finish(self) -> None:
        await asyncio.gather(*self.http)
        # A subscription on every sub-doc, then read until each has every op sent: applies of a
        # closed socket still commit, but nothing else says when.

        def settled(_: dict[str, Any]) -> bool:
            return all(
                e.refused or (e.synced is not None and (e.clocks or [e.since])[-1] >= self.sent[d])
                for d, e in self.current.items()
            )

        while True:
            missing = [d for d in DOCS if d not in self.current or self.current[d].refused]
            if not missing and settled({}):
                break
            subscribes = [(d, *self.subscribe(d, "zero")) for d in missing]
            await self.send([f for _, f, _ in subscribes], [(d, e) for d, _, e in subscribes])
            if not settled({}):
                await self.read_until(settled)
        logs: dict[str, list[dict[str, Any]]] = {}
        for sub_doc in DOCS:
            logs[sub_doc] = []
            while True:
                page = await get_ops(self.client, since=len(logs[sub_doc]), sub_doc=sub_doc)
                logs[sub_doc] += page["ops"]
                if len(logs[sub_doc]) >= page["clock"]:
                    break
            # Every op sent committed once, closed sockets included (all are distinct inserts).
            assert page["clock"] == self.sent[sub_doc] == len(logs[sub_doc]), sub_doc
        for epoch in self.epochs:
            if epoch.refused:
                assert epoch.may_be_refused
                assert epoch.since > 0
                continue
            log = logs[epoch.sub_doc]
            assert epoch.clocks == list(range(epoch.since + 1, epoch.since + 1 + len(epoch.clocks)))
            for clock in epoch.clocks:
                assert log[clock - 1]["clock"] == clock
            if not epoch.ended:
                assert epoch.clocks[-1:] == [self.sent[epoch.sub_doc]] or (
                    epoch.since == self.sent[epoch.sub_doc] and not epoch.clocks
                ), epoch
        assert self.ws is not None
        await self.ws.close()


async def _run_program(
    config: ServerConfig, batch: bool, steps: list[tuple[Any, ...]], *, instances: int = 1
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        clients: list[TestClient[Any, Any]] = []
        for _ in range(instances):
            server = await stack.enter_async_context(
                TestServer(create_app(config), host="127.0.0.1")
            )
            clients.append(await stack.enter_async_context(TestClient(server)))
        program = Program(clients[0], clients[1] if instances > 1 else None)
        try:
            await program.connect(batch)
            for step in steps:
                await program.step(step)
            await program.finish()
        finally:
            for task in program.http:
                task.cancel()
            await asyncio.gather(*program.http, return_exceptions=True)


PROGRAMS = given(batch=st.booleans(), steps=st.lists(STEP, min_size=1, max_size=25))


def _small(**values: Any) -> ServerConfig:
    return ServerConfig(
        token_secret=SECRET, subscriber_queue_limit=50, catchup_page=3, sweep_seconds=600, **values
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@PROGRAMS
def test_random_programs_deliver_each_clock_once_in_order_to_each_subscription(
    batch: bool, steps: list[tuple[Any, ...]]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(_run_program(_small(db_path=Path(tmp) / "cv.db"), batch, steps))


@pytest.mark.postgres
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@PROGRAMS
def test_random_programs_on_postgres_with_commits_from_another_instance(
    postgres_url: str, batch: bool, steps: list[tuple[Any, ...]]
) -> None:
    """The socket on one instance, the HTTP commits on another: those reach the subscribers
    only through LISTEN/NOTIFY and the catch-up it triggers."""

    async def run() -> None:
        async with fresh_schema(postgres_url) as schema:
            config = _small(database_url=_with_schema(postgres_url, schema))
            await _run_program(config, batch, steps, instances=2)

    asyncio.run(run())
