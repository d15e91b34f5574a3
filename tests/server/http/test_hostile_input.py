"""Hostile input over HTTP and the websocket: every bad frame or body gets its stable code, is
never half-applied, never disturbs other subscriptions or clients, and the log stays exact."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import ClientWebSocketResponse, WSMsgType
from aiohttp.test_utils import TestClient

from cv_mutations import fingerprint, new_op_id, parse_op
from cv_server import ServerConfig, create_app
from cv_server.keys import HUB
from cv_server.oplog import IncomingOp
from cv_server.publish import commit_and_publish
from tests.server.conftest import ClientFactory, auth
from tests.server.helpers import counter, get_ops, increment, insert, post_ops

SOCKET = "/v1/workspaces/ws1/socket"
URL = "/v1/workspaces/ws1/docs/tree/ops"


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def _deep_insert(node_id: str, depth: int) -> dict[str, Any]:
    return {
        "type": "node.insert",
        "node_id": node_id,
        "parent_id": "root",
        "fields": {"f": _nested(depth)},
    }


async def _connect(client: TestClient[Any, Any]) -> ClientWebSocketResponse:
    ws: ClientWebSocketResponse = await client.ws_connect(SOCKET, headers=auth("ws1"))
    return ws


async def _next(ws: ClientWebSocketResponse, *types: str) -> dict[str, Any]:
    """The next frame whose type is one of `types` (others, e.g. `synced`, are skipped)."""
    async with asyncio.timeout(10):
        while True:
            frame: dict[str, Any] = await ws.receive_json()
            if frame["type"] in types:
                return frame


async def _subscribe(ws: ClientWebSocketResponse, sub_doc: str = "tree", since: int = 0) -> None:
    await ws.send_json({"type": "subscribe", "sub_doc": sub_doc, "since": since})
    assert (await _next(ws, "synced", "error"))["type"] == "synced"


async def _apply(ws: ClientWebSocketResponse, req: Any, ops: list[dict[str, Any]]) -> Any:
    await ws.send_json({"type": "apply", "sub_doc": "tree", "req": req, "ops": ops})
    return await _next(ws, "ack", "error")


async def _still_serves(client: TestClient[Any, Any], clock: int) -> None:
    """The log holds exactly `clock` ops and a normal client still commits the next one."""
    assert (await get_ops(client))["clock"] == clock
    answer = await post_ops(client, [insert(f"after-{clock}")])
    assert answer["results"][0]["clock"] == clock + 1


# -- ops nested as deep as the parser allows ----------------------------------------------------


@pytest.mark.parametrize("depth", [252, 253, 254])
async def test_an_op_nested_too_deep_to_encode_is_refused_over_http_and_not_applied(
    client: TestClient[Any, Any], depth: int
) -> None:
    ws = await _connect(client)
    await _subscribe(ws)
    await post_ops(client, [insert("seed")])
    assert (await _next(ws, "op"))["clock"] == 1
    problem = await post_ops(client, [insert("ok"), _deep_insert("deep", depth)], status=422)
    assert (problem["code"], problem["op_index"]) == ("invalid_field", 1)
    await _still_serves(client, 1)
    # The live subscriber carries on: the next op it sees is the next clock.
    assert (await _next(ws, "op"))["clock"] == 2
    await ws.close()


async def test_an_op_nested_too_deep_to_encode_is_refused_over_the_socket(
    client: TestClient[Any, Any],
) -> None:
    ws = await _connect(client)
    error = await _apply(ws, 3, [_deep_insert("deep", 252)])
    assert (error["type"], error["code"], error["req"], error["op_index"]) == (
        "error",
        "invalid_field",
        3,
        0,
    )
    ack = await _apply(ws, 4, [insert("a")])
    assert (ack["type"], ack["results"][0]["clock"]) == ("ack", 1)
    await ws.close()


async def test_an_op_logged_deeper_than_orjson_writes_still_reaches_every_subscriber(
    client: TestClient[Any, Any],
) -> None:
    # Such an op can already be in a log (written before the inputs refused it): it must not
    # cut the sub-doc off from subscribers, live or catching up.
    live = await _connect(client)
    await _subscribe(live)
    raw = _deep_insert("deep", 252)
    incoming = IncomingOp(op=parse_op(raw), raw=raw, fingerprint=fingerprint(raw))
    outcomes = await commit_and_publish(client.app, "ws1", "tree", [incoming], False)
    assert outcomes[0].to_json()["clock"] == 1
    frame = await _next(live, "op")
    assert (frame["clock"], frame["op"]["fields"]) == (1, raw["fields"])
    late = await _connect(client)
    await late.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
    frame = await _next(late, "op")
    assert (frame["clock"], frame["op"]["node_id"]) == (1, "deep")
    assert (await _next(late, "synced"))["clock"] == 1
    await _still_serves(client, 1)
    for ws in (live, late):
        assert (await _next(ws, "op"))["clock"] == 2
        await ws.close()


# -- subscribe abuse -----------------------------------------------------------------------------


async def test_a_since_past_the_storage_range_fails_that_subscription_alone(
    client: TestClient[Any, Any],
) -> None:
    ws = await _connect(client)
    await _subscribe(ws, "tree")
    await ws.send_json({"type": "subscribe", "sub_doc": "other", "since": 2**63})
    error = await _next(ws, "error")
    assert (error["code"], error["sub_doc"]) == ("invalid_field", "other")
    await post_ops(client, [insert("a")])
    frame = await _next(ws, "op")
    assert (frame["sub_doc"], frame["clock"]) == ("tree", 1)
    assert not ws.closed
    await ws.close()


async def test_a_since_past_the_head_is_refused_instead_of_skipping_future_clocks(
    client: TestClient[Any, Any],
) -> None:
    await post_ops(client, [insert(f"n{i}") for i in range(3)])
    ws = await _connect(client)
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 10})
    error = await _next(ws, "error", "synced")
    assert (error["type"], error["code"], error["sub_doc"]) == ("error", "invalid_field", "tree")
    # It names the refused `since`: a client tells it from a refusal of a later subscribe.
    assert error["since"] == 10
    assert client.app[HUB].subscriber_count == 0
    # The socket stays usable and a valid resubscribe gets every clock after it.
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 2})
    assert (await _next(ws, "op"))["clock"] == 3
    assert (await _next(ws, "synced"))["clock"] == 3
    await ws.close()


@pytest.mark.parametrize("since", [-1, 1.0, "0", True, None, [0]])
async def test_a_since_of_the_wrong_type_or_sign_is_refused_with_its_sub_doc(
    client: TestClient[Any, Any], since: Any
) -> None:
    ws = await _connect(client)
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": since, "req": "s"})
    error = await _next(ws, "error", "synced")
    assert (error["type"], error["code"], error["sub_doc"], error["req"]) == (
        "error",
        "invalid_field",
        "tree",
        "s",
    )
    assert client.app[HUB].subscriber_count == 0
    await ws.close()


async def test_subscribing_twice_to_one_sub_doc_delivers_each_clock_once(
    client: TestClient[Any, Any],
) -> None:
    ws = await _connect(client)
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
    ack = await _apply(ws, 1, [insert("a")])
    assert ack["results"][0]["clock"] == 1
    assert client.app[HUB].subscriber_count == 1
    await post_ops(client, [insert("b")])
    await post_ops(client, [insert("c")])
    clocks: list[int] = []
    async with asyncio.timeout(10):
        while not clocks or clocks[-1] < 3:
            clocks.append((await _next(ws, "op"))["clock"])
    # Clock 1 may come from the replaced subscription's catch-up and the new one's; 2 and 3 once.
    assert clocks.count(2) == 1
    assert clocks.count(3) == 1
    assert clocks[-2:] == [2, 3]
    await ws.close()


async def test_thousands_of_subscriptions_on_one_socket_are_served_and_all_released(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    count = 2000
    client = await aiohttp_client(create_app(make_config(max_subscriptions_per_socket=count)))
    hub = client.app[HUB]
    names = [f"doc-{i}" for i in range(count)]
    ws = await _connect(client)
    await ws.send_json([{"type": "subscribe", "sub_doc": name, "since": 0} for name in names])
    synced: set[str] = set()
    async with asyncio.timeout(30):
        while len(synced) < count:
            frame = await ws.receive_json()
            assert frame["type"] == "synced"
            synced.add(frame["sub_doc"])
    assert synced == set(names)
    assert hub.subscriber_count == count
    # Unsubscribe all (and some never subscribed), then an apply: handled in order.
    frames: list[dict[str, Any]] = [{"type": "unsubscribe", "sub_doc": n} for n in names]
    frames += [{"type": "unsubscribe", "sub_doc": "never"}] * 3
    frames.append({"type": "apply", "sub_doc": "tree", "req": 1, "ops": [insert("a")]})
    await ws.send_json(frames)
    frame = await ws.receive_json(timeout=10)
    assert (frame["type"], frame["req"]) == ("ack", 1)
    assert hub.subscriber_count == 0
    await ws.send_json([{"type": "subscribe", "sub_doc": n, "since": 0} for n in names[:50]])
    await ws.close()
    async with asyncio.timeout(10):  # the socket's handler releases them on its way out
        while hub.subscriber_count:  # noqa: ASYNC110 (polls server state; no event to await)
            await asyncio.sleep(0.01)
    await _still_serves(client, 1)


# -- frames of the wrong shape -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ({"type": 5, "sub_doc": "tree", "req": 1}, "unknown_message_type"),
        ({"type": None, "sub_doc": "tree", "req": 1}, "unknown_message_type"),
        ({"type": ["apply"], "sub_doc": "tree", "req": 1}, "unknown_message_type"),
        ({"type": "apply", "sub_doc": 7, "req": 1, "ops": []}, "invalid_id"),
        ({"type": "apply", "sub_doc": "TREE", "req": 1, "ops": []}, "invalid_id"),
        ({"type": "apply", "sub_doc": "tree", "req": 1}, "malformed_json"),
        ({"type": "apply", "sub_doc": "tree", "req": 1, "ops": {"a": 1}}, "malformed_json"),
        ({"type": "apply", "sub_doc": "tree", "req": 1, "ops": [5]}, "invalid_field"),
        ({"type": "apply", "sub_doc": "tree", "req": 1, "ops": [[]]}, "invalid_field"),
        ({"type": "apply", "sub_doc": "tree", "req": 1, "ops": [], "atomic": 1}, "invalid_field"),
        (
            {"type": "apply", "sub_doc": "tree", "req": 1, "ops": [{**insert("x"), "index": -1}]},
            "invalid_field",
        ),
        (
            {"type": "apply", "sub_doc": "tree", "req": 1, "ops": [{**insert("x"), "op_id": 5}]},
            "invalid_field",
        ),
    ],
)
async def test_wrong_json_types_in_a_frame_get_their_code_and_apply_nothing(
    client: TestClient[Any, Any], frame: dict[str, Any], code: str
) -> None:
    ws = await _connect(client)
    await ws.send_json(frame)
    error = await _next(ws, "error", "ack")
    assert (error["type"], error["code"], error["req"]) == ("error", code, 1)
    ack = await _apply(ws, 2, [insert("a")])
    assert ack == {
        "type": "ack",
        "req": 2,
        "results": [{"op_id": None, "clock": 1, "duplicate": False}],
    }
    await ws.close()
    await _still_serves(client, 1)


@pytest.mark.parametrize(
    "message",
    ["5", "null", '"apply"', "[]", "[[]]", "[[{}]]", "[" * 2000 + "]" * 2000, "{}" + "x"],
)
async def test_messages_that_are_not_frames_get_malformed_json(
    client: TestClient[Any, Any], message: str
) -> None:
    ws = await _connect(client)
    await ws.send_str(message)
    assert (await _next(ws, "error"))["code"] == "malformed_json"
    assert (await _apply(ws, 1, [insert("a")]))["results"][0]["clock"] == 1
    await ws.close()


async def test_a_binary_frame_gets_malformed_json_and_the_socket_stays_usable(
    client: TestClient[Any, Any],
) -> None:
    ws = await _connect(client)
    apply = b'{"type": "apply", "sub_doc": "tree", "req": 1, "ops": []}'
    await ws.send_bytes(apply)
    assert (await _next(ws, "error", "ack"))["code"] == "malformed_json"
    assert (await _apply(ws, 2, [insert("a")]))["results"][0]["clock"] == 1
    await ws.close()
    assert (await get_ops(client))["clock"] == 1


async def test_a_text_frame_that_is_not_utf8_closes_that_socket_only(
    client: TestClient[Any, Any],
) -> None:
    other = await _connect(client)
    await _subscribe(other)
    ws = await _connect(client)
    await ws._writer.send_frame(b'{"type": "\xff\xfe"}', WSMsgType.TEXT)  # bypasses encoding
    msg = await ws.receive(timeout=10)
    assert msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.CLOSING)
    assert ws.close_code == 1007  # RFC 6455: invalid frame payload data
    await _still_serves(client, 0)
    assert (await _next(other, "op"))["clock"] == 1
    await other.close()


async def test_req_ids_are_echoed_verbatim_whatever_their_type_or_reuse(
    client: TestClient[Any, Any],
) -> None:
    ws = await _connect(client)
    reqs: list[Any] = [7, 7, "x", {"nested": [1, None]}, 2**63, None, 1.5]
    for i, req in enumerate(reqs):
        ack = await _apply(ws, req, [insert(f"n{i}")])
        assert (ack["type"], ack["results"][0]["clock"]) == ("ack", i + 1)
        assert ack["req"] == req
    await ws.close()
    assert (await get_ops(client))["clock"] == len(reqs)


async def test_a_body_that_is_not_utf8_or_nested_too_deep_gets_400(
    client: TestClient[Any, Any],
) -> None:
    headers = {**auth("ws1"), "Content-Type": "application/json"}
    bodies = [
        b'{"ops": [{"type": "node.insert", "node_id": "\xff", "parent_id": "root"}]}',
        b'{"ops": [{"type": "node.insert", "node_id": "\\ud800", "parent_id": "root"}]}',
        b'{"ops": ' + b"[" * 2000 + b"]" * 2000 + b"}",
    ]
    for body in bodies:
        resp = await client.post(URL, data=body, headers=headers)
        assert resp.status == 400
        assert (await resp.json(content_type=None))["code"] == "malformed_json"
    await _still_serves(client, 0)


async def test_a_chunked_body_past_the_limit_gets_413_and_applies_nothing(
    client: TestClient[Any, Any],
) -> None:
    async def chunks() -> Any:  # no Content-Length: the limit must hold while streaming
        yield b'{"ops": [' + b",".join([b"{}"] * 10) + b'], "x": "'
        for _ in range(40):
            yield b"x" * 50_000
        yield b'"}'

    headers = {**auth("ws1"), "Content-Type": "application/json"}
    resp = await client.post(URL, data=chunks(), headers=headers)
    assert resp.status == 413
    assert (await resp.json(content_type=None))["code"] == "body_too_large"
    await _still_serves(client, 0)


# -- batches, duplicates and hang-ups ------------------------------------------------------------


async def test_an_atomic_socket_batch_that_reuses_an_op_id_applies_nothing_and_records_nothing(
    client: TestClient[Any, Any],
) -> None:
    await post_ops(client, [insert("n")])
    ws = await _connect(client)
    op_id = new_op_id()
    frame = {
        "type": "apply",
        "sub_doc": "tree",
        "req": 1,
        "atomic": True,
        "ops": [increment(by=1, op_id=op_id), increment(by=2), increment(by=3, op_id=op_id)],
    }
    await ws.send_json(frame)
    ack = await _next(ws, "ack")
    codes = [r["error"]["code"] for r in ack["results"]]
    assert codes == ["atomic_aborted", "atomic_aborted", "op_id_reuse"]
    assert await counter(client) is None
    assert (await get_ops(client))["clock"] == 1
    # Nothing was recorded under the op_id: the honest op still applies, once.
    retry = await _apply(ws, 2, [increment(by=1, op_id=op_id)])
    assert retry["results"][0] == {"op_id": op_id, "clock": 2, "duplicate": False}
    assert await counter(client) == 1
    await ws.close()


async def test_an_atomic_socket_batch_with_a_rejected_op_applies_none_of_it(
    client: TestClient[Any, Any],
) -> None:
    ws = await _connect(client)
    await _subscribe(ws)
    await post_ops(client, [insert("n")])
    assert (await _next(ws, "op"))["clock"] == 1
    await ws.send_json(
        {
            "type": "apply",
            "sub_doc": "tree",
            "req": 1,
            "atomic": True,
            "ops": [increment(by=5), insert("n2"), insert("n"), increment(by=5)],
        }
    )
    ack = await _next(ws, "ack")
    codes = [r["error"]["code"] for r in ack["results"]]
    assert codes == ["atomic_aborted", "atomic_aborted", "node_exists", "atomic_aborted"]
    assert await counter(client) is None
    await _still_serves(client, 1)
    # Nothing of the aborted batch was broadcast: the next op frame is the next clock.
    assert (await _next(ws, "op"))["clock"] == 2
    await ws.close()


async def test_one_op_id_sent_at_once_over_two_sockets_and_http_applies_once(
    client: TestClient[Any, Any],
) -> None:
    await post_ops(client, [insert("n")])
    a, b = await _connect(client), await _connect(client)
    for round_ in range(20):
        op = increment(by=1)
        sent = {"type": "apply", "sub_doc": "tree", "req": round_, "ops": [op]}
        await asyncio.gather(a.send_json(sent), b.send_json(sent))
        answers = await asyncio.gather(_next(a, "ack"), _next(b, "ack"), post_ops(client, [op]))
        results = [answer["results"][0] for answer in answers]
        assert {r["clock"] for r in results} == {2 + round_}
        assert sum(not r["duplicate"] for r in results) == 1
    assert await counter(client) == 20
    assert (await get_ops(client))["clock"] == 21
    await a.close()
    await b.close()


async def test_closing_right_after_a_batch_loses_nothing_and_a_replay_applies_nothing_twice(
    client: TestClient[Any, Any],
) -> None:
    watch = await _connect(client)
    await _subscribe(watch)
    await post_ops(client, [insert("n")])
    ops = [increment(by=i) for i in range(1, 51)]
    ws = await _connect(client)
    await ws.send_json(
        [{"type": "apply", "sub_doc": "tree", "req": i, "ops": [op]} for i, op in enumerate(ops)]
    )
    await ws.close()  # before any ack could be read
    # Every op of the batch commits anyway, in order, and is broadcast once.
    clocks: list[int] = []
    async with asyncio.timeout(10):
        while not clocks or clocks[-1] < 51:
            clocks.append((await _next(watch, "op"))["clock"])
    assert clocks == list(range(1, 52))
    # The client never heard: its replay is answered from the dedupe records.
    replay = await _connect(client)
    ack = await _apply(replay, "replay", ops)
    assert ack["results"] == [
        {"op_id": op["op_id"], "clock": clock, "duplicate": True}
        for op, clock in zip(ops, range(2, 52), strict=True)
    ]
    assert await counter(client) == sum(range(1, 51))
    await replay.close()
    await watch.close()
    await _still_serves(client, 51)


# -- integers JSON can write but the log cannot keep ----------------------------------------------

BIG = 123456789012345678901234567890  # JSON text, but past 64 bits: orjson reads it as a float


async def _post_raw(client: TestClient[Any, Any], text: str) -> tuple[int, dict[str, Any]]:
    resp = await client.post(
        "/v1/workspaces/ws1/docs/tree/ops",
        data=text,
        headers={**auth("ws1"), "Content-Type": "application/json"},
    )
    body: dict[str, Any] = await resp.json()
    return resp.status, body


@pytest.mark.parametrize("value", [BIG, -BIG, 2**64, -(2**63) - 1])
async def test_an_integer_past_64_bits_is_refused_not_turned_into_a_float(
    client: TestClient[Any, Any], value: int
) -> None:
    """The SDK sends such an integer digit for digit; the server read it as a float and
    committed `by: 1.2345678901234568e+29`, a value the caller never sent."""
    await post_ops(client, [insert("n")])
    # Written by hand: the test client's JSON encoder would be the one to choose the text.
    text = (
        '{"ops": [{"type": "node.increment", "node_id": "n", "field": "count", "by": 1, '
        f'"op_id": "{new_op_id()}"}}, {{"type": "node.increment", "node_id": "n", '
        f'"field": "count", "by": {value}, "op_id": "{new_op_id()}"}}]}}'
    )
    status, body = await _post_raw(client, text)
    assert (status, body["code"], body["op_index"]) == (422, "invalid_field", 1)
    assert "64" in body["detail"]
    assert await counter(client) is None  # nothing of the request applied
    assert [entry["clock"] for entry in (await get_ops(client))["ops"]] == [1]


async def test_integers_at_the_64_bit_edges_are_kept_exactly(
    client: TestClient[Any, Any],
) -> None:
    await post_ops(client, [insert("n"), increment(by=2**64 - 1)])
    assert await counter(client) == 2**64 - 1
    await post_ops(client, [insert("m"), {**increment("m", by=-(2**63))}])
    assert await counter(client, "m") == -(2**63)
    # A string of digits is not a number: it is kept as it is.
    text = (
        '{"ops": [{"type": "node.update", "node_id": "m", "set": {"id": "'
        f'{BIG}"}}, "op_id": "{new_op_id()}"}}]}}'
    )
    status, _ = await _post_raw(client, text)
    assert status == 200


async def test_an_integer_past_64_bits_over_the_websocket_fails_its_apply_alone(
    client: TestClient[Any, Any],
) -> None:
    await post_ops(client, [insert("n")])
    ws = await _connect(client)
    op_id = new_op_id()
    await ws.send_str(
        '{"type": "apply", "sub_doc": "tree", "req": 7, "ops": [{"type": "node.increment", '
        f'"node_id": "n", "field": "count", "by": {BIG}, "op_id": "{op_id}"}}]}}'
    )
    error = await _next(ws, "error", "ack")
    assert (error["type"], error["code"], error["req"], error["op_index"]) == (
        "error",
        "invalid_field",
        7,
        0,
    )
    # The socket is still good for the next apply.
    assert (await _apply(ws, 8, [increment(by=2)]))["results"][0]["clock"] == 2
    assert await counter(client) == 2
    await ws.close()
