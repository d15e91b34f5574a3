"""The websocket: gap-free, duplicate-free subscriptions; acks; slow subscribers cut off."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import ClientWebSocketResponse, WSMsgType
from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.hub import CLOSE_TOO_SLOW
from cv_server.keys import STORES
from tests.server.conftest import ClientFactory, auth
from tests.server.helpers import get_ops, insert, post_ops

SOCKET = "/v1/workspaces/ws1/socket"


async def _collect(ws: ClientWebSocketResponse, sub_doc: str, until_clock: int) -> list[int]:
    """Clocks of `op` frames received for `sub_doc` until `until_clock` arrives."""
    clocks: list[int] = []
    async with asyncio.timeout(30):
        while not clocks or clocks[-1] < until_clock:
            frame = await ws.receive_json()
            if frame["type"] == "op" and frame["sub_doc"] == sub_doc:
                clocks.append(frame["clock"])
    return clocks


async def test_subscribers_joining_at_random_clocks_during_writes_see_each_clock_once_in_order(
    client: TestClient[Any, Any],
) -> None:
    rng = random.Random(7)
    writers, per_writer = 8, 40
    total = writers * per_writer
    committed = 0
    progress = asyncio.Condition()

    async def writer(w: int) -> None:
        nonlocal committed
        for i in range(per_writer):
            await post_ops(client, [insert(f"w{w}-{i}")])
            async with progress:
                committed += 1
                progress.notify_all()

    async def subscriber() -> tuple[int, list[int]]:
        join_at = rng.randint(1, total - 20)  # join at a random point of the write stream
        async with progress:
            await progress.wait_for(lambda: committed >= join_at)
        head = (await get_ops(client))["clock"]
        since = rng.randint(0, head)
        ws = await client.ws_connect(SOCKET, headers=auth("ws1"))
        await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": since})
        clocks = await _collect(ws, "tree", total)
        await ws.close()
        return since, clocks

    results = await asyncio.gather(
        *(subscriber() for _ in range(12)), *(writer(w) for w in range(writers))
    )
    for since, clocks in results[:12]:  # type: ignore[misc]
        assert clocks == list(range(since + 1, total + 1))


async def test_synced_marks_the_end_of_catch_up(client: TestClient[Any, Any]) -> None:
    await post_ops(client, [insert(f"n{i}") for i in range(5)])
    ws = await client.ws_connect(SOCKET, headers=auth("ws1"))
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 2})
    frames = [await ws.receive_json(timeout=5) for _ in range(4)]
    assert [f.get("clock") for f in frames] == [3, 4, 5, 5]
    assert frames[-1] == {"type": "synced", "sub_doc": "tree", "clock": 5}
    await post_ops(client, [insert("live")])
    live = await ws.receive_json(timeout=5)
    assert (live["type"], live["clock"], live["op"]["node_id"]) == ("op", 6, "live")
    await ws.close()


async def test_pipelined_applies_to_one_sub_doc_commit_in_the_order_sent(
    client: TestClient[Any, Any],
) -> None:
    ws = await client.ws_connect(SOCKET, headers=auth("ws1"))
    for req in range(50):
        ops = [insert(f"n{req}")]
        await ws.send_json({"type": "apply", "sub_doc": "tree", "req": req, "ops": ops})
    acks: dict[int, Any] = {}
    async with asyncio.timeout(10):
        while len(acks) < 50:
            frame = await ws.receive_json()
            assert frame["type"] == "ack"
            acks[frame["req"]] = frame["results"][0]["clock"]
    assert [acks[req] for req in range(50)] == list(range(1, 51))
    await ws.close()


async def test_ops_of_other_sub_docs_and_workspaces_are_not_delivered(
    client: TestClient[Any, Any],
) -> None:
    ws = await client.ws_connect(SOCKET, headers=auth("ws1"))
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
    assert (await ws.receive_json(timeout=5))["type"] == "synced"
    await post_ops(client, [insert("elsewhere")], sub_doc="other")
    await post_ops(client, [insert("other-tenant")], workspace="ws2")
    await post_ops(client, [insert("mine")])
    frame = await ws.receive_json(timeout=5)
    assert (frame["sub_doc"], frame["op"]["node_id"]) == ("tree", "mine")
    await ws.close()


async def test_a_subscriber_that_stops_reading_is_closed_with_4008_and_others_carry_on(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    client = await aiohttp_client(create_app(make_config(subscriber_queue_limit=20)))
    stalled = await client.ws_connect(SOCKET, headers=auth("ws1"), max_msg_size=0)
    healthy = await client.ws_connect(SOCKET, headers=auth("ws1"))
    for ws in (stalled, healthy):
        await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
        assert (await ws.receive_json(timeout=5))["type"] == "synced"
    # Big ops fill the stalled socket's kernel buffers quickly; then its queue passes the limit.
    blob = "x" * 50_000
    total = 300
    seen: list[int] = []

    async def read_healthy() -> None:
        while len(seen) < total:
            frame = await healthy.receive_json(timeout=30)
            seen.append(frame["clock"])

    reader = asyncio.create_task(read_healthy())
    for i in range(total):
        op = {"type": "node.insert", "node_id": f"n{i}", "parent_id": "root", "fields": {"b": blob}}
        await post_ops(client, [op])
    await asyncio.wait_for(reader, 30)
    assert seen == list(range(1, total + 1))
    # Now drain the stalled socket: it was cut off with 4008 along the way.
    async with asyncio.timeout(30):
        while True:
            msg = await stalled.receive()
            if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.CLOSING):
                break
    assert stalled.close_code == CLOSE_TOO_SLOW
    await healthy.close()


async def _frames_until(ws: ClientWebSocketResponse, clock: int) -> list[list[dict[str, Any]]]:
    """Each message received (as its list of frames) until the `op` frame of `clock` arrives."""
    messages: list[list[dict[str, Any]]] = []
    async with asyncio.timeout(10):
        while True:
            body = await ws.receive_json()
            frames = body if isinstance(body, list) else [body]
            messages.append(frames)
            if any(f.get("type") == "op" and f["clock"] == clock for f in frames):
                return messages


async def test_a_batching_client_gets_the_frames_of_one_commit_in_one_message(
    client: TestClient[Any, Any],
) -> None:
    batching = await client.ws_connect(SOCKET + "?batch=1", headers=auth("ws1"))
    plain = await client.ws_connect(SOCKET, headers=auth("ws1"))
    for ws in (batching, plain):
        await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
        assert (await ws.receive_json(timeout=5))["type"] == "synced"
    await post_ops(client, [insert(f"n{i}") for i in range(20)])  # one commit, 20 op frames

    batched = await _frames_until(batching, 20)
    single = await _frames_until(plain, 20)
    # The same frames in the same order either way; packed into fewer messages when asked for.
    assert [f["clock"] for m in batched for f in m] == list(range(1, 21))
    assert [f["clock"] for m in single for f in m] == list(range(1, 21))
    assert all(len(m) == 1 for m in single)
    assert len(batched) < 20
    await batching.close()
    await plain.close()


async def test_batched_messages_stay_under_the_frame_limit(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    client = await aiohttp_client(create_app(make_config(max_ws_frame_bytes=600)))
    ws = await client.ws_connect(SOCKET + "?batch=1", headers=auth("ws1"))
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
    assert (await ws.receive_json(timeout=5))["type"] == "synced"
    await post_ops(client, [insert(f"n{i}") for i in range(20)])
    sizes: list[int] = []
    clocks: list[int] = []
    async with asyncio.timeout(10):
        while not clocks or clocks[-1] < 20:
            message = await ws.receive()
            assert message.type == WSMsgType.TEXT
            sizes.append(len(message.data))
            body = message.json()
            clocks.extend(f["clock"] for f in (body if isinstance(body, list) else [body]))
    assert clocks == list(range(1, 21))
    assert max(sizes) <= 600
    assert len(sizes) > 1
    await ws.close()


async def test_an_array_of_frames_is_handled_in_order_frame_by_frame(
    client: TestClient[Any, Any],
) -> None:
    ws = await client.ws_connect(SOCKET, headers=auth("ws1"))
    applies = [
        {"type": "apply", "sub_doc": "tree", "req": req, "ops": [insert(f"n{req}")]}
        for req in range(5)
    ]
    bad = {"type": "apply", "sub_doc": "tree", "req": 99, "ops": [{"type": "node.nope"}]}
    await ws.send_json([*applies[:3], bad, "not a frame", *applies[3:]])
    acks: dict[int, int] = {}
    errors: list[tuple[Any, str]] = []
    async with asyncio.timeout(10):
        while len(acks) < 5 or len(errors) < 2:
            frame = await ws.receive_json()
            if frame["type"] == "ack":
                acks[frame["req"]] = frame["results"][0]["clock"]
            else:
                errors.append((frame.get("req"), frame["code"]))
    assert [acks[req] for req in range(5)] == [1, 2, 3, 4, 5]
    assert sorted(errors, key=str) == sorted(
        [(99, "unknown_op_type"), (None, "malformed_json")], key=str
    )
    await ws.close()


async def test_a_frame_of_an_unknown_kind_is_told_the_member_and_the_kinds_there_are(
    client: TestClient[Any, Any],
) -> None:
    """A client that guessed the kind's member (`kind`, `op`) or its value learns from the error
    alone that the member is `type` and which kinds exist; the socket carries on."""
    ws = await client.ws_connect(SOCKET, headers=auth("ws1"))
    for frame in (
        {"kind": "subscribe", "sub_doc": "tree", "req": 1},  # no `type` at all
        {"type": None, "sub_doc": "tree", "req": 2},
        {"type": "sub", "sub_doc": "tree", "req": 3},
        {"type": 7, "sub_doc": "tree", "req": 4},
    ):
        await ws.send_json(frame)
        error = await ws.receive_json(timeout=10)
        assert (error["type"], error["code"], error["req"]) == (
            "error",
            "unknown_message_type",
            frame["req"],
        )
        message = error["message"]
        assert '"type"' in message, message
        assert all(f'"{kind}"' in message for kind in ("subscribe", "unsubscribe", "apply")), (
            message
        )
    await ws.send_json({"type": "subscribe", "sub_doc": "tree"})
    assert (await ws.receive_json(timeout=10))["type"] == "synced"
    await ws.close()


async def test_a_failed_commit_answers_internal_and_the_socket_carries_on(
    client: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = client.app[STORES].oplog
    real_job = store._append_job
    calls = 0

    def failing_once(*args: Any, **kwargs: Any) -> Any:  # runs in the SQLite writer thread
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("disk on fire")
        return real_job(*args, **kwargs)

    monkeypatch.setattr(store, "_append_job", failing_once)
    ws = await client.ws_connect(SOCKET, headers=auth("ws1"))
    await ws.send_json({"type": "apply", "sub_doc": "tree", "req": 1, "ops": [insert("a")]})
    await ws.send_json({"type": "apply", "sub_doc": "tree", "req": 2, "ops": [insert("b")]})
    first = await ws.receive_json(timeout=5)
    second = await ws.receive_json(timeout=5)
    assert (first["type"], first["req"], first["code"]) == ("error", 1, "internal")
    assert (second["type"], second["req"]) == ("ack", 2)
    assert second["results"][0]["clock"] == 1  # the failed apply left nothing behind
    await ws.close()


async def test_op_frames_carry_the_commit_time_the_log_read_shows_caught_up_or_live(
    server: TestClient[Any, Any],
) -> None:
    before = time.time()
    await post_ops(server, [insert("a"), insert("b")])
    ws = await server.ws_connect(SOCKET, headers=auth("ws1"))
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
    frames = [await ws.receive_json(timeout=5) for _ in range(3)]
    assert [f["type"] for f in frames] == ["op", "op", "synced"]
    await post_ops(server, [insert("live")])
    frames[2] = await ws.receive_json(timeout=5)
    after = time.time()
    await ws.close()
    assert [f["clock"] for f in frames] == [1, 2, 3]
    stamps = [f["committed_at"] for f in frames]
    assert all(isinstance(at, float) and before - 1 <= at <= after + 1 for at in stamps), stamps
    logged = (await get_ops(server))["ops"]
    assert [(e["clock"], e["committed_at"]) for e in logged] == [
        (1, stamps[0]),
        (2, stamps[1]),
        (3, stamps[2]),
    ]
