"""Ordering on the websocket and broadcast path (SQLite backend): acks and broadcasts of one
sub-doc leave in clock order, every subscriber sees every clock once, a slow subscriber costs
only itself, and batched messages keep to the frame cap."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import ClientWebSocketResponse, WSMsgType
from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.hub import encode_entry
from cv_server.keys import STORES
from cv_server.oplog import LogEntry
from cv_server.sqlite.engine import Transaction
from cv_server.sqlite.oplog import SQLiteOpLogStore
from tests.server.conftest import ClientFactory, auth
from tests.server.helpers import get_doc, get_ops, insert, post_ops

SOCKET = "/v1/workspaces/ws1/socket"


def _padded(node_id: str, pad: str) -> dict[str, Any]:
    return {"type": "node.insert", "node_id": node_id, "parent_id": "root", "fields": {"p": pad}}


def _frame_bytes(sub_doc: str, clock: int, op: dict[str, Any]) -> int:
    """UTF-8 size of the `op` frame the server sends for `op` at `clock`."""
    return len(encode_entry(sub_doc, LogEntry(clock, op.get("op_id"), op)).text.encode())


async def _subscribe(ws: ClientWebSocketResponse, sub_doc: str, since: int = 0) -> None:
    await ws.send_json({"type": "subscribe", "sub_doc": sub_doc, "since": since})


async def _frames(ws: ClientWebSocketResponse) -> list[dict[str, Any]]:
    """The frames of the next message (an array from a `?batch=1` socket, else one frame)."""
    body = await ws.receive_json()
    return body if isinstance(body, list) else [body]


async def _op_clocks_until(ws: ClientWebSocketResponse, sub_doc: str, clock: int) -> list[int]:
    """Clocks of the `op` frames for `sub_doc` received until `clock` arrives."""
    clocks: list[int] = []
    async with asyncio.timeout(30):
        while not clocks or clocks[-1] < clock:
            for frame in await _frames(ws):
                if frame["type"] == "op" and frame["sub_doc"] == sub_doc:
                    clocks.append(frame["clock"])
    return clocks


async def _messages_until(ws: ClientWebSocketResponse, clock: int) -> list[bytes]:
    """Every message received (as the UTF-8 bytes on the wire) until `op` `clock` arrives."""
    messages: list[bytes] = []
    async with asyncio.timeout(10):
        while True:
            message = await ws.receive()
            assert message.type == WSMsgType.TEXT, message
            messages.append(message.data.encode())
            body = message.json()
            if any(f.get("clock") == clock for f in (body if isinstance(body, list) else [body])):
                return messages


# -- `?batch=1` and the frame cap ---------------------------------------------------------------


async def test_a_batched_message_counts_its_brackets_against_the_frame_cap(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    cap = 1000
    client = await aiohttp_client(create_app(make_config(max_ws_frame_bytes=cap)))
    ws = await client.ws_connect(SOCKET + "?batch=1", headers=auth("ws1"))
    await _subscribe(ws, "tree")
    assert (await ws.receive_json(timeout=5))["type"] == "synced"
    # Two frames whose sizes plus the comma come to cap - 1: packed as `[a,b]` that is cap + 1.
    second = _padded("b", "")
    room = cap - 2 - _frame_bytes("tree", 2, second)
    first = _padded("a", "x" * (room - _frame_bytes("tree", 1, _padded("a", ""))))
    assert _frame_bytes("tree", 1, first) + 1 + _frame_bytes("tree", 2, second) == cap - 1
    await post_ops(client, [first, second])  # one commit: both frames queue together
    messages = await _messages_until(ws, 2)
    assert max(len(m) for m in messages) <= cap
    await ws.close()


async def test_a_batched_message_of_non_ascii_ops_stays_under_the_cap_in_bytes(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    cap = 2000
    client = await aiohttp_client(create_app(make_config(max_ws_frame_bytes=cap)))
    ws = await client.ws_connect(SOCKET + "?batch=1", headers=auth("ws1"))
    await _subscribe(ws, "tree")
    assert (await ws.receive_json(timeout=5))["type"] == "synced"
    # 300 characters but 900 bytes each: the cap is in bytes, as the receiver counts it.
    await post_ops(client, [_padded(f"n{i}", "語" * 300) for i in range(10)])
    messages = await _messages_until(ws, 10)
    assert max(len(m) for m in messages) <= cap
    await ws.close()


async def test_an_op_frame_bigger_than_the_cap_goes_alone_between_batches_in_order(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    cap = 1500
    config = make_config(max_ws_frame_bytes=cap, max_body_bytes=1024 * 1024)
    client = await aiohttp_client(create_app(config))
    ws = await client.ws_connect(SOCKET + "?batch=1", headers=auth("ws1"), max_msg_size=0)
    await _subscribe(ws, "tree")
    assert (await ws.receive_json(timeout=5))["type"] == "synced"
    # Over HTTP an op may be bigger than the socket's cap; it cannot be split, so it goes alone.
    ops = [insert(f"a{i}") for i in range(5)] + [_padded("big", "x" * 5000)]
    ops += [insert(f"b{i}") for i in range(5)]
    await post_ops(client, ops)
    messages = await _messages_until(ws, 11)
    clocks: list[int] = []
    for raw in messages:
        body = orjson.loads(raw)
        frames = body if isinstance(body, list) else [body]
        clocks.extend(f["clock"] for f in frames)
        if any(f["clock"] == 6 for f in frames):
            assert isinstance(body, dict)  # alone, not wrapped in an array
        else:
            assert len(raw) <= cap
    assert clocks == list(range(1, 12))
    assert len(messages) < 11  # the small ones around it were still packed
    await ws.close()


# -- catch-up is paced by the connection, not cut off -------------------------------------------


async def test_a_subscriber_catching_up_a_log_bigger_than_its_queue_limit_is_not_cut_off(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    client = await aiohttp_client(
        create_app(make_config(subscriber_queue_limit=50, catchup_page=20))
    )
    total = 1000
    for start in range(0, total, 20):
        # Big ops fill the kernel's socket buffers, so the server's own queue is what grows.
        await post_ops(client, [_padded(f"n{i}", "x" * 20_000) for i in range(start, start + 20)])
    ws = await client.ws_connect(SOCKET, headers=auth("ws1"))
    await _subscribe(ws, "tree")
    clocks: list[int] = []
    async with asyncio.timeout(60):
        while True:
            message = await ws.receive()
            assert message.type == WSMsgType.TEXT, (message, len(clocks))
            frame = message.json()
            if frame["type"] == "synced":
                break
            clocks.append(frame["clock"])
            # A reader slower than the disk, yet reading: the log is the buffer during catch-up,
            # so it must be paced, not closed with 4008 over and over at every reconnect.
            await get_ops(client, since=total)
    assert clocks == list(range(1, total + 1))
    assert frame["clock"] == total
    await ws.close()


# -- one socket, many applies --------------------------------------------------------------------


async def test_pipelined_applies_to_many_sub_docs_are_answered_once_after_their_broadcasts(
    client: TestClient[Any, Any],
) -> None:
    rng = random.Random(11)
    docs = [f"d{i}" for i in range(5)]
    ws = await client.ws_connect(SOCKET + "?batch=1", headers=auth("ws1"))
    for doc in docs:
        await _subscribe(ws, doc)
    synced = 0
    async with asyncio.timeout(10):
        while synced < len(docs):
            synced += sum(f["type"] == "synced" for f in await _frames(ws))
    expected: dict[int, tuple[str, int, bool]] = {}  # req -> (doc, ops, atomic that fails)
    frames: list[dict[str, Any]] = []
    for req in range(300):
        doc = rng.choice(docs)
        count = rng.randint(1, 3)
        ops = [insert(f"r{req}-{i}") for i in range(count)]
        failing = rng.random() < 0.2
        if failing:  # a rejected op fails the whole atomic batch: nothing applied or broadcast
            ops.append(insert(f"r{req}-0"))
        frames.append({"type": "apply", "sub_doc": doc, "req": req, "ops": ops, "atomic": True})
        expected[req] = (doc, count, failing)
    for start in range(0, len(frames), 7):  # some alone, most packed in arrays
        chunk = frames[start : start + 7]
        await ws.send_json(chunk[0] if len(chunk) == 1 else chunk)

    acks: dict[int, list[dict[str, Any]]] = {}
    seen: dict[str, list[int]] = {doc: [] for doc in docs}
    last_ack: dict[str, int] = dict.fromkeys(docs, 0)
    async with asyncio.timeout(30):
        while len(acks) < len(expected):
            for frame in await _frames(ws):
                if frame["type"] == "op":
                    seen[frame["sub_doc"]].append(frame["clock"])
                    continue
                assert frame["type"] == "ack", frame
                req = frame["req"]
                assert req not in acks, f"req {req} answered twice"
                acks[req] = frame["results"]
                doc, count, failing = expected[req]
                if failing:
                    assert {r["error"]["code"] for r in frame["results"]} <= {
                        "atomic_aborted",
                        "node_exists",
                    }
                    continue
                clocks = [r["clock"] for r in frame["results"]]
                # Gap-free within the apply, after the last ack of that sub-doc, and its
                # broadcast already went out on this socket (publish, then answer).
                assert clocks == list(range(last_ack[doc] + 1, last_ack[doc] + count + 1))
                assert seen[doc][-count:] == clocks
                last_ack[doc] = clocks[-1]
    for doc in docs:
        committed = sum(c for d, c, failing in expected.values() if d == doc and not failing)
        assert seen[doc] == list(range(1, committed + 1))
        assert (await get_ops(client, sub_doc=doc))["clock"] == committed
    await ws.close()


# -- many writers, many subscribers --------------------------------------------------------------


async def test_http_and_socket_writers_interleaved_reach_twenty_subscribers_once_in_order(
    client: TestClient[Any, Any],
) -> None:
    rng = random.Random(3)
    socket_writers, http_writers, per_writer = 3, 3, 40
    total = (socket_writers + http_writers) * per_writer
    early = []
    for i in range(10):
        ws = await client.ws_connect(SOCKET + ("?batch=1" if i % 2 else ""), headers=auth("ws1"))
        await _subscribe(ws, "tree")
        assert (await _frames(ws))[0]["type"] == "synced"
        early.append(ws)
    half_done = asyncio.Event()
    committed = 0

    def count_commit() -> None:
        nonlocal committed
        committed += 1
        if committed == total // 2:
            half_done.set()

    async def socket_writer(w: int) -> None:
        ws = await client.ws_connect(SOCKET, headers=auth("ws1"))
        for i in range(per_writer):
            frame = {"type": "apply", "sub_doc": "tree", "req": i, "ops": [insert(f"s{w}-{i}")]}
            await ws.send_json(frame)
        acked = 0
        async with asyncio.timeout(30):
            while acked < per_writer:
                frame = await ws.receive_json()
                assert (frame["type"], frame["req"]) == ("ack", acked)
                acked += 1
                count_commit()
        await ws.close()

    async def http_writer(w: int) -> None:
        for i in range(per_writer):
            await post_ops(client, [insert(f"h{w}-{i}")])
            count_commit()

    async def late_subscriber(batch: bool) -> tuple[int, list[int]]:
        # Joins mid-burst, at a clock it may or may not have seen: the catch-up/live boundary.
        await half_done.wait()
        since = rng.randint(0, (await get_ops(client, since=0))["clock"])
        ws = await client.ws_connect(SOCKET + ("?batch=1" if batch else ""), headers=auth("ws1"))
        await _subscribe(ws, "tree", since)
        try:
            return since, await _op_clocks_until(ws, "tree", total)
        finally:
            await ws.close()

    async def early_subscriber(ws: ClientWebSocketResponse) -> tuple[int, list[int]]:
        try:
            return 0, await _op_clocks_until(ws, "tree", total)
        finally:
            await ws.close()

    results = await asyncio.gather(
        *(early_subscriber(ws) for ws in early),
        *(late_subscriber(i % 2 == 1) for i in range(10)),
        *(socket_writer(w) for w in range(socket_writers)),
        *(http_writer(w) for w in range(http_writers)),
    )
    for since, clocks in results[:20]:  # type: ignore[misc]
        assert clocks == list(range(since + 1, total + 1))
    assert (await get_doc(client))["clock"] == total


async def test_unsubscribe_then_resubscribe_from_the_last_clock_seen_has_no_gap_or_duplicate(
    client: TestClient[Any, Any],
) -> None:
    ws = await client.ws_connect(SOCKET, headers=auth("ws1"))
    await _subscribe(ws, "tree")
    assert (await ws.receive_json(timeout=5))["type"] == "synced"
    total = 200
    writes = asyncio.ensure_future(
        asyncio.gather(*(post_ops(client, [insert(f"n{i}")]) for i in range(total)))
    )
    clocks: list[int] = []
    barrier = 0
    async with asyncio.timeout(30):
        while not clocks or clocks[-1] < total:
            frame = await ws.receive_json()
            if frame["type"] == "op":
                clocks.append(frame["clock"])
                if len(clocks) % 25 == 0 and barrier == 0 and clocks[-1] < total:
                    barrier = -len(clocks)
                    # A frame answered with an error marks the point the unsubscribe was
                    # handled: no op of the old subscription may follow that answer.
                    await ws.send_json(
                        [{"type": "unsubscribe", "sub_doc": "tree"}, {"req": barrier}]
                    )
            elif frame["type"] == "error":
                assert frame["req"] == barrier
                barrier = 0
                await _subscribe(ws, "tree", clocks[-1])
            else:
                assert frame["type"] == "synced"
    await writes
    assert clocks == list(range(1, total + 1))
    await ws.close()


# -- a failed group commit -----------------------------------------------------------------------


async def test_socket_applies_in_a_group_whose_commit_fails_are_not_acked_nor_broadcast(
    client: TestClient[Any, Any],
) -> None:
    store = client.app[STORES].oplog
    assert isinstance(store, SQLiteOpLogStore)
    db = store.db

    def add_deferred_check(tx: Transaction) -> None:
        # A deferred foreign key is checked at COMMIT: it fails the whole group, not one job.
        tx.execute("CREATE TABLE parent_rows (id INTEGER PRIMARY KEY)")
        tx.execute(
            "CREATE TABLE child_rows (parent INTEGER"
            " REFERENCES parent_rows(id) DEFERRABLE INITIALLY DEFERRED)"
        )

    await db.write(add_deferred_check)
    await post_ops(client, [insert("base")])
    watcher = await client.ws_connect(SOCKET, headers=auth("ws1"))
    await _subscribe(watcher, "tree", 1)
    assert (await watcher.receive_json(timeout=5))["type"] == "synced"
    writer = await client.ws_connect(SOCKET, headers=auth("ws1"))

    loop = asyncio.get_running_loop()
    started: asyncio.Future[None] = loop.create_future()
    release = threading.Event()

    def hold(tx: Transaction) -> None:
        loop.call_soon_threadsafe(started.set_result, None)
        release.wait(30)

    held = db.submit(hold)
    try:
        await asyncio.wait_for(started, 30)
        # Queued behind the held job, so these all form the next group; the barrier's answer
        # proves the socket handed them to the writer before the poison is queued.
        applies = [
            {"type": "apply", "sub_doc": "tree", "req": req, "ops": [insert(f"lost{req}")]}
            for req in range(3)
        ]
        await writer.send_json([*applies, {"req": "barrier"}])
        assert (await writer.receive_json(timeout=10))["req"] == "barrier"
        poison = db.submit(lambda tx: tx.execute("INSERT INTO child_rows VALUES (42)"))
        await writer.send_json(
            [
                {"type": "apply", "sub_doc": "tree", "req": 3, "ops": [insert("lost3")]},
                {"req": "barrier"},
            ]
        )
        assert (await writer.receive_json(timeout=10))["req"] == "barrier"
    finally:
        release.set()
    await held
    errors = [await writer.receive_json(timeout=10) for _ in range(4)]
    assert [(e["type"], e["req"], e["code"]) for e in errors] == [
        ("error", req, "internal") for req in range(4)
    ]
    assert poison.exception() is not None

    # The cache was taken back with the disk: the next apply gets clock 2, and is the next
    # thing the watcher sees (nothing of the failed group was broadcast).
    await writer.send_json({"type": "apply", "sub_doc": "tree", "req": 9, "ops": [insert("kept")]})
    ack = await writer.receive_json(timeout=10)
    assert (ack["type"], ack["req"], ack["results"][0]["clock"]) == ("ack", 9, 2)
    frame = await watcher.receive_json(timeout=10)
    assert (frame["type"], frame["clock"], frame["op"]["node_id"]) == ("op", 2, "kept")
    doc = await get_doc(client)
    assert doc["clock"] == 2
    assert set(doc["state"]["nodes"]) == {"root", "base", "kept"}
    assert [op["clock"] for op in (await get_ops(client))["ops"]] == [1, 2]
    await writer.close()
    await watcher.close()
