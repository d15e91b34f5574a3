"""The SDK against servers that break the wire contract (docs/protocol.md): scripted aiohttp servers
on loopback send duplicated, skipped, reordered, mangled and unreadable frames, acks that do not fit
their request, errors that name no request, HTTP answers that are not answers, and close the socket
with every class of code. The SDK must keep its promise (every clock exactly once, in order; every
op answered with its own result, resent under its own op_id) or fail with a typed error, never
silently and never by hanging."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import WSMsgType, web
from aiohttp.test_utils import TestServer

from cv_mutations import NodeIncrement
from cv_workspace_client import (
    Commit,
    Committed,
    InvalidRequestError,
    ProtocolError,
    StillPendingError,
    Subscription,
    WorkspaceClient,
    WorkspaceError,
)
from cv_workspace_client._core.subscription import ResumeTracker, Verdict

from ..helpers import WS, RecordingSleep, fast_config, token_for

TIMEOUT = 10
SUB = "tree"

ServerFactory = Callable[..., Awaitable[TestServer]]


MINE = "mine-op-1"


def oid(clock: int) -> str:
    return f"clock-{clock:04d}"


def log_op(clock: int) -> dict[str, Any]:
    if clock == 1:
        return {"type": "node.insert", "node_id": "n", "parent_id": "root", "op_id": oid(1)}
    return {"type": "node.increment", "node_id": "n", "field": "c", "by": 1, "op_id": oid(clock)}


def op_frame(clock: int, sub_doc: str = SUB, op: Any = None) -> dict[str, Any]:
    return {
        "type": "op",
        "sub_doc": sub_doc,
        "clock": clock,
        "op_id": oid(clock),
        "op": log_op(clock) if op is None else op,
    }


def synced(clock: int, sub_doc: str = SUB) -> dict[str, Any]:
    return {"type": "synced", "sub_doc": sub_doc, "clock": clock}


class Peer:
    """The server's end of one websocket: the client's frames one at a time (arrays unpacked)."""

    def __init__(self, request: web.Request, ws: web.WebSocketResponse, number: int) -> None:
        self.request = request
        self.ws = ws
        self.number = number
        self._frames: list[dict[str, Any]] = []

    async def frame(self) -> dict[str, Any]:
        while not self._frames:
            message = await self.ws.receive(timeout=TIMEOUT)
            if message.type is not WSMsgType.TEXT:
                raise ConnectionError(f"the client left: {message.type}")
            body = orjson.loads(message.data)
            self._frames.extend(body if isinstance(body, list) else [body])
        return self._frames.pop(0)

    async def frame_of(self, kind: str) -> dict[str, Any]:
        while (frame := await self.frame())["type"] != kind:
            pass
        return frame

    async def send(self, *frames: dict[str, Any]) -> None:
        for frame in frames:
            await self.ws.send_str(orjson.dumps(frame).decode())


Script = Callable[[Peer], Awaitable[None]]
#: (the request, its ops, how many posts so far) → the answer to give instead, or None.
PostHook = Callable[[web.Request, list[dict[str, Any]], int], Awaitable[web.StreamResponse | None]]


@dataclass
class Scripted:
    """A server whose websocket follows `script` on the connections it names and behaves
    everywhere else; its HTTP routes serve a log of `head` ops and commit applies once per
    op_id (so a resend is answered `duplicate: true`)."""

    head: int = 0
    #: Connection number (1 = the first) → what the server does on it instead of behaving.
    scripts: dict[int, Script] = field(default_factory=dict)
    #: Replaces the POST ops route's answer while it returns a response (None: behave).
    post_hook: PostHook | None = None
    #: Replaces the log read's answer (None: behave).
    read_hook: Callable[[int, int], dict[str, Any] | None] = lambda since, limit: None
    connections: int = 0
    subscribes: list[tuple[int, str, int]] = field(default_factory=list)
    #: The op_ids of every apply, in the order they arrived (over HTTP or the socket).
    sends: list[list[str]] = field(default_factory=list)
    posts: int = 0
    committed: dict[str, int] = field(default_factory=dict)
    peers: list[Peer] = field(default_factory=list)

    def commit(self, ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.sends.append([op["op_id"] for op in ops])
        results = []
        for op in ops:
            clock = self.committed.get(op["op_id"])
            duplicate = clock is not None
            if clock is None:
                self.head += 1
                clock = self.committed[op["op_id"]] = self.head
            results.append({"op_id": op["op_id"], "clock": clock, "duplicate": duplicate})
        return results

    async def behave(self, peer: Peer) -> None:
        while True:
            frame = await peer.frame()
            if frame["type"] == "subscribe":
                self.subscribes.append((peer.number, frame["sub_doc"], frame["since"]))
                since = frame["since"]
                await peer.send(*(op_frame(c) for c in range(since + 1, self.head + 1)))
                await peer.send(synced(max(since, self.head)))
            elif frame["type"] == "apply":
                results = self.commit(frame["ops"])
                await peer.send({"type": "ack", "req": frame["req"], "results": results})

    async def socket(self, request: web.Request) -> web.WebSocketResponse:
        self.connections += 1
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        peer = Peer(request, ws, self.connections)
        self.peers.append(peer)
        script = self.scripts.get(peer.number, self.behave)
        with contextlib.suppress(ConnectionError, asyncio.CancelledError, TimeoutError):
            await script(peer)
            async for _ in ws:  # the script is done: stay open, say nothing more
                pass
        return ws

    async def read(self, request: web.Request) -> web.Response:
        since, limit = int(request.query["since"]), int(request.query["limit"])
        answer = self.read_hook(since, limit)
        if answer is None:
            ops = [
                {"clock": c, "op_id": oid(c), "op": log_op(c)}
                for c in range(since + 1, min(self.head, since + limit) + 1)
            ]
            answer = {"clock": self.head, "ops": ops}
        return web.json_response(answer)

    async def post(self, request: web.Request) -> web.StreamResponse:
        self.posts += 1
        ops = (await request.json())["ops"]
        answer = None if self.post_hook is None else await self.post_hook(request, ops, self.posts)
        if answer is not None:
            self.sends.append([op["op_id"] for op in ops])
            return answer
        return web.json_response({"results": self.commit(ops)})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/workspaces/{ws}/socket", self.socket)
        app.router.add_get("/v1/workspaces/{ws}/docs/{sub_doc}/ops", self.read)
        app.router.add_post("/v1/workspaces/{ws}/docs/{sub_doc}/ops", self.post)
        return app


@contextlib.asynccontextmanager
async def client_of(
    aiohttp_server: ServerFactory, scripted: Scripted, **config: Any
) -> AsyncIterator[WorkspaceClient]:
    server = await aiohttp_server(scripted.app())
    url = str(server.make_url("")).rstrip("/")
    async with WorkspaceClient(url, token=token_for(WS), config=fast_config(**config)) as client:
        yield client


async def take(sub: Subscription, count: int) -> list[int]:
    clocks: list[int] = []
    while len(clocks) < count:
        clocks.append((await asyncio.wait_for(anext(sub), TIMEOUT)).clock)
    return clocks


async def increment(client: WorkspaceClient) -> Commit:
    op = NodeIncrement(node_id="n", field="c", op_id=MINE)
    return await asyncio.wait_for(client.apply_op(WS, SUB, op), TIMEOUT)


# -- subscriptions: frames that repeat, skip or reorder clocks -------------------------------------


async def test_an_op_frame_sent_twice_is_yielded_once(aiohttp_server: ServerFactory) -> None:
    async def script(peer: Peer) -> None:
        await peer.frame_of("subscribe")
        await peer.send(op_frame(1), op_frame(1), op_frame(2), op_frame(2), synced(2))
        await peer.send(op_frame(3), op_frame(2), op_frame(3), op_frame(4))

    scripted = Scripted(head=4, scripts={1: script})
    async with client_of(aiohttp_server, scripted) as client, client.subscribe(WS, SUB) as sub:
        assert await take(sub, 4) == [1, 2, 3, 4]
        assert sub.duplicates_dropped == 4


async def test_a_refusal_of_an_earlier_subscribe_does_not_fail_the_one_that_replaced_it(
    aiohttp_server: ServerFactory,
) -> None:
    """The app opens a subscription past the head, closes it before the server's refusal
    arrives and subscribes again from 0: the refusal crossing the new subscribe names the
    `since` it refused, and must not fail the new subscription with the old one's error."""

    async def script(peer: Peer) -> None:
        assert (await peer.frame_of("subscribe"))["since"] == 100
        assert (await peer.frame())["type"] == "unsubscribe"
        assert (await peer.frame_of("subscribe"))["since"] == 0
        refusal = "since 100 is past the head clock 3"
        await peer.send(
            {
                "type": "error",
                "code": "invalid_field",
                "message": refusal,
                "sub_doc": SUB,
                "since": 100,
            }
        )
        await peer.send(*(op_frame(c) for c in range(1, 4)), synced(3))

    scripted = Scripted(head=3, scripts={1: script})
    async with client_of(aiohttp_server, scripted) as client:
        await client.connect(WS, timeout=TIMEOUT)
        async with client.subscribe(WS, SUB, since=100):
            pass  # registered on entry (its subscribe goes out), closed on exit (unsubscribe)
        async with client.subscribe(WS, SUB) as fresh:
            assert await take(fresh, 3) == [1, 2, 3]


async def test_a_skipped_clock_is_fetched_from_the_log_before_the_next(
    aiohttp_server: ServerFactory,
) -> None:
    async def script(peer: Peer) -> None:
        await peer.frame_of("subscribe")
        await peer.send(op_frame(1), op_frame(3), synced(3), op_frame(6))

    scripted = Scripted(head=6, scripts={1: script})
    async with client_of(aiohttp_server, scripted) as client, client.subscribe(WS, SUB) as sub:
        assert await take(sub, 6) == [1, 2, 3, 4, 5, 6]


async def test_clocks_sent_out_of_order_are_yielded_in_order(
    aiohttp_server: ServerFactory,
) -> None:
    async def script(peer: Peer) -> None:
        await peer.frame_of("subscribe")
        await peer.send(op_frame(2), op_frame(1), op_frame(4), op_frame(3), synced(4))

    scripted = Scripted(head=4, scripts={1: script})
    async with client_of(aiohttp_server, scripted) as client, client.subscribe(WS, SUB) as sub:
        assert await take(sub, 4) == [1, 2, 3, 4]


async def test_a_clock_the_log_does_not_have_fails_typed_instead_of_waiting(
    aiohttp_server: ServerFactory,
) -> None:
    async def script(peer: Peer) -> None:
        await peer.frame_of("subscribe")
        await peer.send(op_frame(1), op_frame(9))

    scripted = Scripted(head=1, scripts={1: script})
    async with client_of(aiohttp_server, scripted) as client, client.subscribe(WS, SUB) as sub:
        assert await take(sub, 1) == [1]
        with pytest.raises(ProtocolError) as caught:
            await take(sub, 1)
        assert caught.value.code == "gap_unfillable"


async def test_a_synced_head_behind_what_was_delivered_with_a_log_behind_too_fails_typed(
    aiohttp_server: ServerFactory,
) -> None:
    """The server lost clocks 4 and 5 after the subscription got them (restored from an older
    copy): new ops committed at those clocks would be dropped as already seen."""

    async def script(peer: Peer) -> None:
        await peer.frame_of("subscribe")
        await peer.send(*(op_frame(c) for c in range(1, 6)))

    async def lost(peer: Peer) -> None:
        await peer.send(synced(3))
        # Then new ops at the lost clocks: the app must not be told nothing happened.
        await peer.send(op_frame(4, op=log_op(4) | {"by": 7}), op_frame(5), op_frame(6))

    scripted = Scripted(head=5, scripts={1: script})
    async with client_of(aiohttp_server, scripted) as client, client.subscribe(WS, SUB) as sub:
        assert await take(sub, 5) == [1, 2, 3, 4, 5]
        scripted.head = 3
        await lost(scripted.peers[0])
        with pytest.raises(InvalidRequestError) as caught:
            await take(sub, 1)
        assert caught.value.code == "invalid_field"


async def test_a_stale_synced_head_with_a_healthy_log_is_harmless(
    aiohttp_server: ServerFactory,
) -> None:
    async def script(peer: Peer) -> None:
        await peer.frame_of("subscribe")
        await peer.send(*(op_frame(c) for c in range(1, 6)), synced(2), op_frame(6), synced(6))

    scripted = Scripted(head=6, scripts={1: script})
    async with client_of(aiohttp_server, scripted) as client, client.subscribe(WS, SUB) as sub:
        assert await take(sub, 6) == [1, 2, 3, 4, 5, 6]


async def test_frames_for_a_sub_doc_not_subscribed_are_ignored(
    aiohttp_server: ServerFactory,
) -> None:
    async def script(peer: Peer) -> None:
        await peer.frame_of("subscribe")
        await peer.send(op_frame(1, sub_doc="other"), synced(5, sub_doc="other"))
        await peer.send(op_frame(1), op_frame(2, sub_doc="other"), op_frame(2), synced(2))

    scripted = Scripted(head=2, scripts={1: script})
    async with client_of(aiohttp_server, scripted) as client, client.subscribe(WS, SUB) as sub:
        assert await take(sub, 2) == [1, 2]
        assert sub.duplicates_dropped == 0


def test_a_delivered_clock_retracted_is_due_again_and_nothing_else_moves() -> None:
    tracker = ResumeTracker(since=4)
    assert tracker.offer(5) is Verdict.DELIVER
    tracker.retract(5)
    assert tracker.last == 4
    assert tracker.offer(5) is Verdict.DELIVER
    tracker.retract(3)  # not the last delivered: nothing to take back
    assert tracker.last == 5


# -- subscriptions: messages that cannot be read ---------------------------------------------------


async def test_a_message_that_is_not_json_is_recovered_by_a_reconnect(
    aiohttp_server: ServerFactory,
) -> None:
    """The mangled message was clock 2, the last op for now: ignoring it left the app waiting
    for an op the server had sent, until some later op exposed the hole."""

    async def script(peer: Peer) -> None:
        await peer.frame_of("subscribe")
        await peer.send(op_frame(1))
        await peer.ws.send_str(orjson.dumps(op_frame(2)).decode()[:-20])

    scripted = Scripted(head=2, scripts={1: script})
    sleep = RecordingSleep()
    async with (
        client_of(aiohttp_server, scripted, sleep=sleep) as client,
        client.subscribe(WS, SUB) as sub,
    ):
        assert await take(sub, 2) == [1, 2]
    assert scripted.subscribes == [(2, SUB, 1)]
    # A server that broke the protocol may do it again on every connection: back off first.
    assert len(sleep.delays) == 1


@pytest.mark.parametrize(
    "bad",
    [
        "garbage",
        ["an op frame that is a list"],
        {"type": "op", "sub_doc": SUB, "clock": "3", "op_id": oid(3), "op": log_op(3)},
        {"type": "op", "sub_doc": SUB, "clock": None, "op_id": oid(3), "op": log_op(3)},
    ],
    ids=["string", "list", "clock-as-text", "no-clock"],
)
async def test_an_array_mixing_good_and_bad_frames_yields_every_clock_once_in_order(
    aiohttp_server: ServerFactory, bad: Any
) -> None:
    async def script(peer: Peer) -> None:
        await peer.frame_of("subscribe")
        # The bad frame stands for clock 3, the last op for now: nothing later exposes it.
        message = [op_frame(1), op_frame(2), bad]
        await peer.ws.send_str(orjson.dumps(message).decode())

    scripted = Scripted(head=3, scripts={1: script})
    async with client_of(aiohttp_server, scripted) as client, client.subscribe(WS, SUB) as sub:
        assert await take(sub, 3) == [1, 2, 3]


async def test_an_unknown_frame_type_is_ignored_for_later_protocol_versions(
    aiohttp_server: ServerFactory,
) -> None:
    async def script(peer: Peer) -> None:
        await peer.frame_of("subscribe")
        await peer.send(op_frame(1), {"type": "presence", "who": "x"}, op_frame(2), synced(2))

    scripted = Scripted(head=2, scripts={1: script})
    async with client_of(aiohttp_server, scripted) as client, client.subscribe(WS, SUB) as sub:
        assert await take(sub, 2) == [1, 2]
    assert scripted.connections == 1


async def test_an_op_frame_whose_op_does_not_parse_is_taken_from_the_log(
    aiohttp_server: ServerFactory,
) -> None:
    """A proxy mangled clock 2's op: the app got `InvalidOp` (not a `WorkspaceError`), and the
    clock counted as delivered, so iterating on skipped it for good."""

    async def script(peer: Peer) -> None:
        await peer.frame_of("subscribe")
        await peer.send(op_frame(1), op_frame(2, op={"type": "node.bogus"}), op_frame(3))

    scripted = Scripted(head=3, scripts={1: script})
    async with client_of(aiohttp_server, scripted) as client, client.subscribe(WS, SUB) as sub:
        got = [await asyncio.wait_for(anext(sub), TIMEOUT) for _ in range(3)]
    assert [c.clock for c in got] == [1, 2, 3]
    assert isinstance(got[1], Committed)
    assert got[1].op == NodeIncrement(node_id="n", field="c", by=1, op_id=oid(2))


async def test_an_op_the_log_cannot_parse_either_fails_typed_and_is_never_skipped(
    aiohttp_server: ServerFactory,
) -> None:
    bogus = {"type": "node.bogus", "op_id": oid(2)}

    async def script(peer: Peer) -> None:
        await peer.frame_of("subscribe")
        await peer.send(op_frame(1), op_frame(2, op=bogus), op_frame(3), synced(3))

    def read(since: int, limit: int) -> dict[str, Any]:
        ops = [
            {"clock": c, "op_id": oid(c), "op": bogus if c == 2 else log_op(c)}
            for c in range(since + 1, 4)
        ]
        return {"clock": 3, "ops": ops}

    scripted = Scripted(head=3, scripts={1: script}, read_hook=read)
    async with client_of(aiohttp_server, scripted) as client, client.subscribe(WS, SUB) as sub:
        assert await take(sub, 1) == [1]
        for _ in range(2):  # iterating on after the error must not skip the clock
            with pytest.raises(ProtocolError):
                await take(sub, 1)
            assert sub.clock == 1


# -- subscriptions: every class of close code, mid-catch-up and mid-live ---------------------------


CLOSES = [1000, 1001, 1006, 1011, 1013, 4000, 4008, 4999]


async def close_with(peer: Peer, code: int) -> None:
    if code == 1006:  # abnormal: no close frame at all, the connection just drops
        assert peer.request.transport is not None
        peer.request.transport.abort()
    else:
        await peer.ws.close(code=code, message=b"scripted")


@pytest.mark.parametrize("code", CLOSES)
async def test_a_socket_closed_mid_catch_up_resumes_without_gap_or_duplicate(
    aiohttp_server: ServerFactory, code: int
) -> None:
    async def script(peer: Peer) -> None:
        await peer.frame_of("subscribe")
        await peer.send(*(op_frame(c) for c in range(1, 4)))  # 3 of 6, no `synced` yet
        await close_with(peer, code)

    scripted = Scripted(head=6, scripts={1: script})
    sleep = RecordingSleep()
    async with (
        client_of(aiohttp_server, scripted, sleep=sleep) as client,
        client.subscribe(WS, SUB) as sub,
    ):
        assert await take(sub, 6) == [1, 2, 3, 4, 5, 6]
        assert sub.duplicates_dropped == 0
    assert scripted.subscribes == [(2, SUB, 3)]
    if code in (1011, 1013):  # the server says it is failing: back off before reconnecting
        assert sleep.delays


@pytest.mark.parametrize("code", CLOSES)
async def test_a_socket_closed_mid_live_resumes_without_gap_or_duplicate(
    aiohttp_server: ServerFactory, code: int
) -> None:
    async def script(peer: Peer) -> None:
        await peer.frame_of("subscribe")
        await peer.send(*(op_frame(c) for c in range(1, 4)), synced(3), op_frame(4))
        await close_with(peer, code)

    scripted = Scripted(head=6, scripts={1: script})
    async with client_of(aiohttp_server, scripted) as client, client.subscribe(WS, SUB) as sub:
        assert await take(sub, 6) == [1, 2, 3, 4, 5, 6]
        assert sub.duplicates_dropped == 0
    assert scripted.subscribes == [(2, SUB, 4)]


@pytest.mark.parametrize("code", [4001, 4003])
async def test_a_socket_closed_for_auth_mid_catch_up_fails_typed_after_what_it_had(
    aiohttp_server: ServerFactory, code: int
) -> None:
    async def script(peer: Peer) -> None:
        await peer.frame_of("subscribe")
        await peer.send(op_frame(1), op_frame(2))
        await peer.ws.close(code=code, message=b"scripted")

    scripted = Scripted(head=6, scripts={1: script})
    async with client_of(aiohttp_server, scripted) as client, client.subscribe(WS, SUB) as sub:
        assert await take(sub, 2) == [1, 2]
        with pytest.raises(WorkspaceError) as caught:
            await take(sub, 1)
    assert caught.value.code == {4001: "unauthorized", 4003: "forbidden_workspace"}[code]
    assert not caught.value.retryable
    assert scripted.connections == 1


# -- acks ------------------------------------------------------------------------------------------


async def ack_with(
    peer: Peer, change: Callable[[dict[str, Any], list[dict[str, Any]]], Any]
) -> None:
    """Answer the first apply with `change(frame, honest results)` (a frame or a list of them)."""
    frame = await peer.frame_of("apply")
    scripted_results = [
        {"op_id": op["op_id"], "clock": 100 + i, "duplicate": False}
        for i, op in enumerate(frame["ops"])
    ]
    answer = change(frame, scripted_results)
    for item in answer if isinstance(answer, list) else [answer]:
        await peer.send(item)


async def test_acks_for_unknown_or_answered_reqs_are_ignored(
    aiohttp_server: ServerFactory,
) -> None:
    scripted = Scripted(head=1)

    async def script(peer: Peer) -> None:
        frame = await peer.frame_of("apply")
        results = scripted.commit(frame["ops"])
        stranger = [{"op_id": MINE, "clock": 99, "duplicate": False}]
        await peer.send({"type": "ack", "req": frame["req"] + 1000, "results": stranger})
        await peer.send({"type": "ack", "req": str(frame["req"]), "results": stranger})
        await peer.send({"type": "ack", "req": frame["req"], "results": results})
        await peer.send({"type": "ack", "req": frame["req"], "results": stranger})
        await scripted.behave(peer)

    scripted.scripts[1] = script
    async with client_of(aiohttp_server, scripted) as client:
        await client.connect(WS, timeout=TIMEOUT)
        assert await increment(client) == Commit(clock=2, op_id=MINE)
        assert scripted.posts == 0  # over the socket, as scripted
        second = NodeIncrement(node_id="n", field="c", op_id="next-op-1")
        assert await asyncio.wait_for(client.apply_op(WS, SUB, second), TIMEOUT) == Commit(
            clock=3, op_id="next-op-1"
        )
    assert scripted.sends == [[MINE], ["next-op-1"]]


@pytest.mark.parametrize(
    "change",
    [
        lambda frame, results: {"type": "ack", "req": frame["req"], "results": []},
        lambda frame, results: {"type": "ack", "req": frame["req"], "results": results * 2},
        lambda frame, results: {"type": "ack", "req": frame["req"]},
        lambda frame, results: {"type": "ack", "req": frame["req"], "results": {"op_id": MINE}},
        lambda frame, results: {
            "type": "ack",
            "req": frame["req"],
            "results": [results[0] | {"op_id": "someone-else-1"}],
        },
        lambda frame, results: {
            "type": "ack",
            "req": frame["req"],
            "results": [results[0] | {"clock": "100"}],
        },
    ],
    ids=["none", "too-many", "missing", "not-a-list", "other-op-id", "bad-clock"],
)
async def test_an_ack_that_does_not_fit_its_request_is_resent_under_the_same_op_id(
    aiohttp_server: ServerFactory, change: Any
) -> None:
    async def script(peer: Peer) -> None:
        await ack_with(peer, change)
        await scripted.behave(peer)

    scripted = Scripted(head=1, scripts={1: script})
    async with client_of(aiohttp_server, scripted) as client:
        await client.connect(WS, timeout=TIMEOUT)
        assert await increment(client) == Commit(clock=2, op_id=MINE)
        assert scripted.posts == 0  # over the socket, as scripted
    assert scripted.sends == [[MINE]]  # the scripted ack committed nothing; the resend did


async def test_results_in_another_order_resolve_no_op_with_anothers_result(
    aiohttp_server: ServerFactory,
) -> None:
    async def script(peer: Peer) -> None:
        await ack_with(
            peer,
            lambda frame, results: {"type": "ack", "req": frame["req"], "results": results[::-1]},
        )
        await scripted.behave(peer)

    scripted = Scripted(head=1, scripts={1: script})
    async with client_of(aiohttp_server, scripted) as client:
        await client.connect(WS, timeout=TIMEOUT)
        ops = [NodeIncrement(node_id="n", field="c", op_id=f"mine-op-{i}") for i in range(3)]
        outcomes = await asyncio.wait_for(client.apply_ops(WS, SUB, ops), TIMEOUT)
        assert scripted.posts == 0  # over the socket, as scripted
    assert outcomes == [Commit(clock=2 + i, op_id=f"mine-op-{i}") for i in range(3)]
    assert scripted.sends == [[f"mine-op-{i}" for i in range(3)]]


async def test_an_ack_arriving_after_the_deadline_resent_the_batch_is_ignored(
    aiohttp_server: ServerFactory,
) -> None:
    scripted = Scripted(head=1)
    applies: list[dict[str, Any]] = []

    async def script(peer: Peer) -> None:
        applies.append(await peer.frame_of("apply"))
        scripted.commit(applies[0]["ops"])  # committed, but the ack is late...
        applies.append(await peer.frame_of("apply"))  # ...so late the client resent the batch
        wrong = [{"op_id": MINE, "clock": 77, "duplicate": False}]
        await peer.send({"type": "ack", "req": applies[0]["req"], "results": wrong})
        results = scripted.commit(applies[1]["ops"])
        await peer.send({"type": "ack", "req": applies[1]["req"], "results": results})
        await scripted.behave(peer)

    scripted.scripts[1] = script
    async with client_of(aiohttp_server, scripted, request_timeout_seconds=0.3) as client:
        await client.connect(WS, timeout=TIMEOUT)
        assert await increment(client) == Commit(clock=2, op_id=MINE, duplicate=True)
        assert scripted.posts == 0  # over the socket, as scripted
    first, second = applies
    assert second["ops"] == first["ops"]
    assert second["req"] != first["req"]


async def test_an_error_frame_without_req_gets_the_batches_in_flight_resent_at_once(
    aiohttp_server: ServerFactory,
) -> None:
    """The server could not read a message (its `error` names no request): the applies in it
    were lost, and are resent at once, not after the whole ack deadline (300 s by default)."""

    async def script(peer: Peer) -> None:
        await peer.frame_of("apply")
        await peer.send({"type": "error", "code": "malformed_json", "message": "bad message"})
        await scripted.behave(peer)

    scripted = Scripted(head=1, scripts={1: script})
    async with client_of(aiohttp_server, scripted) as client:
        await client.connect(WS, timeout=TIMEOUT)
        assert await increment(client) == Commit(clock=2, op_id=MINE)
    assert scripted.sends == [[MINE]]  # the resend (over HTTP while the socket reconnects)


async def test_an_error_frame_for_an_unknown_req_is_ignored(
    aiohttp_server: ServerFactory,
) -> None:
    async def script(peer: Peer) -> None:
        frame = await peer.frame_of("apply")
        await peer.send({"type": "error", "req": frame["req"] + 1, "code": "op_id_reuse"})
        await peer.send(
            {"type": "ack", "req": frame["req"], "results": scripted.commit(frame["ops"])}
        )
        await scripted.behave(peer)

    scripted = Scripted(head=1, scripts={1: script})
    async with client_of(aiohttp_server, scripted) as client:
        await client.connect(WS, timeout=TIMEOUT)
        assert await increment(client) == Commit(clock=2, op_id=MINE)
        assert scripted.posts == 0  # over the socket, as scripted
    assert scripted.connections == 1


async def test_a_message_too_large_for_the_client_does_not_fail_the_op_in_flight_as_too_large(
    aiohttp_server: ServerFactory,
) -> None:
    """The client closes 1009 itself when the server sends more than it takes (aiohttp's 4 MiB):
    that close was read as the server refusing the client's frame, and the op in flight (which
    the server had committed) was failed for good with `body_too_large`."""

    async def script(peer: Peer) -> None:
        await peer.frame_of("apply")
        await peer.ws.send_str('{"type":"presence","padding":"' + "x" * (5 << 20) + '"}')
        await scripted.behave(peer)

    scripted = Scripted(head=1, scripts={1: script})
    async with client_of(aiohttp_server, scripted) as client:
        await client.connect(WS, timeout=TIMEOUT)
        assert await increment(client) == Commit(clock=2, op_id=MINE)  # resent, not failed
    assert scripted.sends == [[MINE]]


# -- HTTP ------------------------------------------------------------------------------------------


def once(response: Callable[[], web.StreamResponse]) -> PostHook:
    async def hook(request: web.Request, ops: list[dict[str, Any]], number: int) -> Any:
        return response() if number == 1 else None

    return hook


@pytest.mark.parametrize(
    "response",
    [
        lambda: web.Response(text="<html>gateway says hi</html>", content_type="text/html"),
        lambda: web.Response(text='{"results": [', content_type="application/json"),
        lambda: web.json_response({"results": []}),
        lambda: web.json_response({"results": [{}, {}]}),
        lambda: web.json_response(["results"]),
        lambda: web.json_response({"results": [{"op_id": "other", "clock": 5}]}),
        lambda: web.Response(status=204),
        lambda: web.json_response({"results": []}, status=201),
        lambda: web.Response(status=302, headers={"Location": "/elsewhere"}),
        lambda: web.Response(status=307, headers={"Location": "/v1/workspaces/ws1/docs/x/ops"}),
        lambda: web.Response(status=304),
        lambda: web.Response(body=b"x" * (20 << 20), content_type="application/json"),
    ],
    ids=[
        "html",
        "truncated-json",
        "no-results",
        "too-many-results",
        "not-an-object",
        "other-op-id",
        "204",
        "201",
        "302",
        "307",
        "304",
        "huge",
    ],
)
async def test_an_http_answer_that_is_not_an_answer_is_resent_under_the_same_op_id(
    aiohttp_server: ServerFactory, response: Callable[[], web.StreamResponse]
) -> None:
    scripted = Scripted(head=1, post_hook=once(response))
    async with client_of(aiohttp_server, scripted, ops_over_websocket=False) as client:
        assert await increment(client) == Commit(clock=2, op_id=MINE)
    assert scripted.sends == [[MINE], [MINE]]
    assert scripted.posts == 2


async def test_a_body_cut_short_of_its_content_length_is_resent_under_the_same_op_id(
    aiohttp_server: ServerFactory,
) -> None:
    async def cut(request: web.Request, ops: list[dict[str, Any]], number: int) -> Any:
        if number > 1:
            return None
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = 1000
        await response.prepare(request)
        await response.write(b'{"results": [{"op_id": MINE, "clock": 2')
        assert request.transport is not None
        request.transport.abort()
        return response

    scripted = Scripted(head=1, post_hook=cut)
    async with client_of(aiohttp_server, scripted, ops_over_websocket=False) as client:
        assert await increment(client) == Commit(clock=2, op_id=MINE)
    assert scripted.posts == 2


async def test_a_redirect_elsewhere_is_not_followed_nor_its_answer_taken(
    aiohttp_server: ServerFactory,
) -> None:
    """A 307 re-sent the ops to wherever it pointed, and that host's answer was taken for the
    commit (here: clock 50 of an op the server never committed)."""
    elsewhere: list[str | None] = []

    async def catch(request: web.Request) -> web.Response:
        elsewhere.append(request.headers.get("Authorization"))
        return web.json_response({"results": [{"op_id": MINE, "clock": 50}]})

    other = web.Application()
    other.router.add_route("*", "/{tail:.*}", catch)
    other_server = await aiohttp_server(other)
    target = str(other_server.make_url("/v1/workspaces/ws1/docs/tree/ops"))
    scripted = Scripted(
        head=1,
        post_hook=once(lambda: web.Response(status=307, headers={"Location": target})),
    )
    async with client_of(aiohttp_server, scripted, ops_over_websocket=False) as client:
        assert await increment(client) == Commit(clock=2, op_id=MINE)
    assert elsewhere == []


async def test_an_http_answer_that_is_never_right_leaves_the_op_pending_typed(
    aiohttp_server: ServerFactory,
) -> None:
    async def moved(request: web.Request, ops: list[dict[str, Any]], number: int) -> Any:
        return web.Response(status=301, headers={"Location": "/x"})

    scripted = Scripted(head=1, post_hook=moved)
    async with client_of(
        aiohttp_server, scripted, ops_over_websocket=False, retry_attempts=3
    ) as client:
        with pytest.raises(StillPendingError) as caught:
            await increment(client)
    assert isinstance(caught.value.last_error, ProtocolError)
    assert caught.value.op_id == MINE
    assert scripted.sends == [[MINE]] * 3


async def test_a_proxys_bare_413_halves_the_batch_instead_of_failing_every_op(
    aiohttp_server: ServerFactory,
) -> None:
    """A proxy in front (nginx's `client_max_body_size`) answers 413 with an HTML page, no
    problem code: read as `http_413`, every op of the batch failed for good, though each fits
    alone; the server's own `body_too_large` makes the SDK halve the batch."""

    async def small_bodies_only(request: web.Request, ops: list[Any], number: int) -> Any:
        if len(ops) > 1:
            return web.Response(status=413, text="<html>413 Request Entity Too Large</html>")
        return None

    scripted = Scripted(head=1, post_hook=small_bodies_only)
    async with client_of(aiohttp_server, scripted, ops_over_websocket=False) as client:
        ops = [NodeIncrement(node_id="n", field="c", op_id=f"mine-op-{i}") for i in range(3)]
        outcomes = await asyncio.wait_for(client.apply_ops(WS, SUB, ops), TIMEOUT)
    assert outcomes == [Commit(clock=2 + i, op_id=f"mine-op-{i}") for i in range(3)]


async def test_a_proxys_bare_408_is_retried_under_the_same_op_id(
    aiohttp_server: ServerFactory,
) -> None:
    """408: the request was not received in time (a proxy's `client_body_timeout`). Read as a
    final `http_408`, the op failed for good on a transient hiccup."""
    scripted = Scripted(
        head=1, post_hook=once(lambda: web.Response(status=408, text="Request Timeout"))
    )
    async with client_of(aiohttp_server, scripted, ops_over_websocket=False) as client:
        assert await increment(client) == Commit(clock=2, op_id=MINE)
    assert scripted.sends == [[MINE], [MINE]]


async def test_reads_whose_clock_is_not_a_number_fail_typed(aiohttp_server: ServerFactory) -> None:
    """Python's JSON reader takes `Infinity`; `int()` of it raised `OverflowError` to the app."""

    async def infinite(request: web.Request) -> web.Response:
        body = '{"clock": Infinity, "state": {"nodes": {}}, "ops": []}'
        return web.Response(text=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/workspaces/{ws}/docs/{sub_doc}", infinite)
    app.router.add_get("/v1/workspaces/{ws}/docs/{sub_doc}/ops", infinite)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    async with WorkspaceClient(url, token=token_for(WS), config=fast_config()) as client:
        with pytest.raises(ProtocolError):
            await client.get_state(WS, SUB)
        with pytest.raises(ProtocolError):
            await client.read_ops(WS, SUB)


async def test_a_read_answer_that_does_not_fit_once_is_retried_not_raised(
    aiohttp_server: ServerFactory,
) -> None:
    """A 200 whose JSON has the wrong shape (a proxy's, a server mid-deploy) is one failed
    attempt, like an answer that never came: raised at once, it reached the app (and ended a
    subscription's catch-up) on the first try."""
    answers = {"state": 0, "ops": 0}

    async def state(request: web.Request) -> web.Response:
        answers["state"] += 1
        if answers["state"] == 1:
            return web.json_response({"status": "ok"})
        root: dict[str, Any] = {"parent": None, "children": [], "fields": {}}
        return web.json_response({"clock": 0, "state": {"nodes": {"root": root}}})

    async def ops(request: web.Request) -> web.Response:
        answers["ops"] += 1
        if answers["ops"] == 1:
            return web.json_response({"ops": "not a list", "clock": 0})
        return web.json_response(
            {"clock": 1, "ops": [{"clock": 1, "op_id": oid(1), "op": log_op(1)}]}
        )

    app = web.Application()
    app.router.add_get("/v1/workspaces/{ws}/docs/{sub_doc}", state)
    app.router.add_get("/v1/workspaces/{ws}/docs/{sub_doc}/ops", ops)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    async with WorkspaceClient(url, token=token_for(WS), config=fast_config()) as client:
        clock, _ = await asyncio.wait_for(client.get_state(WS, SUB), TIMEOUT)
        head, entries = await asyncio.wait_for(client.read_ops(WS, SUB), TIMEOUT)
    assert (clock, head, [e.clock for e in entries]) == (0, 1, [1])
    assert answers == {"state": 2, "ops": 2}
