"""Hostile websocket frames, sent as raw frames on a real socket: a `req` no answer can carry is
refused before any work (never committed without an ack, never an HTTP 500 on the upgraded
stream), and a frame past the size limit always reaches the sender as the 1009 close, never as a
connection reset."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from cv_mutations import new_op_id
from cv_server import ServerConfig
from cv_server.http.socket import _Session
from cv_server.keys import CONNECTIONS, STORES
from tests.server.conftest import SECRET
from tests.server.helpers import insert
from tests.server.wire import RawSocket, Served, frame, served


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Served]:
    async with served(ServerConfig(db_path=tmp_path / "cv.db", token_secret=SECRET)) as running:
        yield running


def _nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def _list_nested(depth: int) -> str:
    return "[" * depth + "]" * depth


async def _clock(server: Served) -> int:
    head, _ = await server.app[STORES].oplog.read_since("ws1", "tree", 0, 1)
    return head


async def _ack_and_op(ws: RawSocket) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ack of an apply and its broadcast to the same socket, in whichever order they come."""
    seen: dict[str, dict[str, Any]] = {}
    while len(seen) < 2:
        frame = await ws.next_json("ack", "op", "error")
        assert frame["type"] != "error", frame
        seen[frame["type"]] = frame
    return seen["ack"], seen["op"]


async def _subscribed(server: Served) -> RawSocket:
    ws = await RawSocket.connect(server.port)
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
    assert (await ws.next_json("synced"))["clock"] == await _clock(server)
    return ws


def _apply(req: str, node_id: str) -> str:
    op = json.dumps(insert(node_id, op_id=new_op_id()))
    return f'{{"type":"apply","sub_doc":"tree","req":{req},"ops":[{op}]}}'


#: `req` values orjson cannot write inside an answer frame, as raw JSON text.
UNANSWERABLE = {
    "past-64-bits": "18446744073709551616",
    "below-64-bits": "-9223372036854775809",
    "nested-300": _nested(300),
    "list-nested-300": _list_nested(300),
}


@pytest.mark.parametrize("req", UNANSWERABLE.values(), ids=UNANSWERABLE.keys())
async def test_an_apply_whose_req_cannot_be_answered_is_refused_before_it_commits(
    server: Served, req: str
) -> None:
    ws = await _subscribed(server)
    # A long run of digits elsewhere makes the server read the frame exactly (no float).
    await ws.send_text(_apply(req, "bad")[:-1] + ',"pad":"0000000000000000000000"}')
    error = await ws.next_json("error", "ack")
    assert (error["type"], error["code"]) == ("error", "invalid_field"), error
    assert "req" not in error
    assert await _clock(server) == 0
    # The socket and its subscription live on: the next apply is acked and broadcast.
    await ws.send_text(_apply("1", "good"))
    ack, op = await _ack_and_op(ws)
    assert (ack["req"], ack["results"][0]["clock"], op["clock"]) == (1, 1, 1)
    await ws.close()


@pytest.mark.parametrize("req", UNANSWERABLE.values(), ids=UNANSWERABLE.keys())
async def test_any_frame_with_such_a_req_gets_an_error_frame_not_a_dead_socket(
    server: Served, req: str
) -> None:
    ws = await _subscribed(server)
    for text in (
        f'{{"type":"nope","sub_doc":"tree","req":{req}}}',
        f'{{"type":"apply","sub_doc":"TREE","req":{req},"ops":[]}}',
        f'{{"type":"subscribe","sub_doc":"tree","since":-1,"req":{req}}}',
        f'[{{"type":"unsubscribe","sub_doc":"other","req":{req}}}]',
    ):
        await ws.send_text(text)
        error = await ws.next_json("error")
        assert error["code"] == "invalid_field", error
    await ws.send_text(_apply('"still here"', "good"))
    ack, op = await _ack_and_op(ws)
    assert (ack["req"], op["clock"]) == ("still here", 1)
    await ws.close()


async def test_a_frame_type_nested_past_the_repr_limit_gets_unknown_message_type(
    server: Served,
) -> None:
    ws = await _subscribed(server)
    await ws.send_text(f'{{"type":{_list_nested(1000)},"sub_doc":"tree","req":3}}')
    error = await ws.next_json("error")
    assert (error["code"], error["req"]) == ("unknown_message_type", 3)
    assert len(error["message"]) < 200
    await ws.close()


async def test_reqs_an_answer_can_carry_are_still_echoed_verbatim(server: Served) -> None:
    ws = await RawSocket.connect(server.port)
    for i, req in enumerate(
        ["18446744073709551615", "-9223372036854775808", _nested(250), '"\\u00e9"']
    ):
        await ws.send_text(_apply(req, f"n{i}")[:-1] + ',"pad":"0000000000000000000000"}')
        ack = await ws.next_json("ack", "error")
        assert ack["type"] == "ack", ack
        assert ack["req"] == json.loads(req)
    await ws.close()


# -- a frame past the limit ------------------------------------------------------------------------


async def _send_too_big(server: Served) -> tuple[int | None, str]:
    """Send a 1.5 MB frame from a socket with a small send buffer (it leaves only as fast as
    the server reads it); what the client sees: the close code, or the error it got."""
    ws = await RawSocket.connect(server.port, send_buffer=16 * 1024)
    payload = _apply("1", "big")[:-1] + ',"pad":"' + "x" * 1_500_000 + '"}'
    try:
        await ws.send_text(payload)
        while ws.close_code is None:
            await ws.receive()
        return ws.close_code, "close"
    except (ConnectionError, asyncio.IncompleteReadError) as exc:
        return None, type(exc).__name__
    finally:
        await ws.close()


async def test_a_frame_past_the_limit_always_reaches_the_sender_as_the_1009_close(
    server: Served,
) -> None:
    other = await _subscribed(server)
    seen = [await _send_too_big(server) for _ in range(5)]
    assert seen == [(1009, "close")] * 5
    assert await _clock(server) == 0
    # Nothing of it was applied, and other sockets were not disturbed.
    await other.send_text(_apply("7", "after"))
    assert (await other.next_json("ack"))["results"][0]["clock"] == 1
    await other.close()


async def test_after_the_1009_close_the_server_closes_its_end_once_the_peer_has(
    server: Served,
) -> None:
    """The lingering ends with the peer: the server's end of the stream follows the close
    frame (end-of-stream, not a reset), and the connection is gone from the server."""
    ws = await RawSocket.connect(server.port, send_buffer=16 * 1024)
    await ws.send_text('{"pad":"' + "x" * 1_500_000 + '"}')
    opcode, _ = await ws.receive()
    assert (opcode, ws.close_code) == (0x8, 1009)
    async with asyncio.timeout(10):
        assert await ws.reader.read() == b""  # end of stream: the server shut its write side
    await ws.close()
    async with asyncio.timeout(10):  # the handler returns once the connection is closed
        while server.app[CONNECTIONS]:  # noqa: ASYNC110 (server state; no event to await)
            await asyncio.sleep(0.01)


# -- a failure of the server's own ---------------------------------------------------------------


async def test_a_message_the_server_fails_on_gets_an_internal_error_and_the_socket_lives(
    server: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = await _subscribed(server)
    real = _Session.handle

    def fail_on_boom(self: _Session, text: str) -> None:
        if "boom" in text:
            raise RuntimeError("a bug")
        real(self, text)

    monkeypatch.setattr(_Session, "handle", fail_on_boom)
    await ws.send_json({"type": "boom"})
    assert (await ws.next_json("error"))["code"] == "internal"
    await ws.send_text(_apply("2", "good"))
    ack, op = await _ack_and_op(ws)
    assert (ack["req"], op["clock"]) == (2, 1)
    await ws.close()


async def test_a_failure_after_the_upgrade_never_writes_http_onto_the_socket(
    server: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(self: _Session) -> None:
        raise RuntimeError("a bug between two messages")

    monkeypatch.setattr(_Session, "room", broken)
    ws = await RawSocket.connect(server.port)
    await ws.send_json({"type": "unsubscribe", "sub_doc": "tree"})
    opcode, payload = await ws.receive()
    assert (opcode, ws.close_code) == (0x8, 1011), payload  # a websocket close, not HTTP
    await ws.send(frame(b"\x03\xf3", opcode=0x8))  # the client's close (1011) in answer
    async with asyncio.timeout(10):
        assert await ws.reader.read() == b""
    await ws.close()
