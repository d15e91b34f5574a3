"""Every bad input gets its stable code, and the log is left exactly as it was
(docs/problems.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import WSMsgType
from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from tests.server.conftest import ClientFactory, auth
from tests.server.helpers import get_ops, insert, post_ops

URL = "/v1/workspaces/ws1/docs/tree/ops"


async def _raw_post(client: TestClient[Any, Any], data: bytes, url: str = URL) -> Any:
    resp = await client.post(
        url, data=data, headers={**auth("ws1"), "Content-Type": "application/json"}
    )
    assert resp.headers["Content-Type"].startswith("application/problem+json")
    return resp.status, await resp.json(content_type=None)


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "malformed_json"),
        (
            b'{"ops": [{"type": "node.update", "node_id": "root", "set": {"x": NaN}}]}',
            400,
            "malformed_json",
        ),
        (b'"a string"', 400, "malformed_json"),
        (b'{"ops": {"type": "node.insert"}}', 400, "malformed_json"),
        (b'{"ops": []}', 422, "invalid_field"),
        (b'{"ops": [], "surprise": 1}', 422, "invalid_field"),
        (b'{"ops": [], "atomic": "yes"}', 422, "invalid_field"),
        (b'{"ops": [{"type": "node.teleport", "node_id": "a"}]}', 422, "unknown_op_type"),
        (b'{"ops": [{"node_id": "a"}]}', 422, "unknown_op_type"),
        (
            b'{"ops": [{"type": "node.insert", "node_id": "a b", "parent_id": "root"}]}',
            422,
            "invalid_id",
        ),
        (
            b'{"ops": [{"type": "node.insert", "node_id": "a", "parent_id": "root",'
            b' "op_id": "short"}]}',
            422,
            "invalid_id",
        ),
        (
            b'{"ops": [{"type": "node.increment", "node_id": "a", "field": "n", "by": "x"}]}',
            422,
            "invalid_field",
        ),
        (
            b'{"ops": [{"type": "node.insert", "node_id": "a", "parent_id": "root", "x": 1}]}',
            422,
            "invalid_field",
        ),
    ],
)
async def test_bad_bodies_get_their_code_and_leave_the_log_unchanged(
    client: TestClient[Any, Any], body: bytes, status: int, code: str
) -> None:
    await post_ops(client, [insert("seed")])
    got_status, problem = await _raw_post(client, body)
    assert (got_status, problem["code"]) == (status, code)
    assert problem["type"] == "about:blank"
    assert (await get_ops(client))["clock"] == 1


async def test_one_malformed_op_in_a_batch_applies_none_of_it(
    client: TestClient[Any, Any],
) -> None:
    ops = [insert("a"), insert("b"), {"type": "node.insert", "node_id": "c"}]
    problem = await post_ops(client, ops, status=422)
    assert problem["code"] == "invalid_field"
    assert problem["op_index"] == 2
    assert (await get_ops(client))["clock"] == 0


async def test_invalid_ids_in_the_path_are_refused(client: TestClient[Any, Any]) -> None:
    status, problem = await _raw_post(client, b'{"ops": []}', "/v1/workspaces/ws1/docs/BAD/ops")
    assert (status, problem["code"]) == (422, "invalid_id")


async def test_too_many_ops_per_request_is_refused(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    client = await aiohttp_client(create_app(make_config(max_ops_per_request=5)))
    problem = await post_ops(client, [insert(f"n{i}") for i in range(6)], status=422)
    assert problem["code"] == "too_many_ops"
    assert (await get_ops(client))["clock"] == 0


async def test_a_body_too_large_gets_413(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    client = await aiohttp_client(create_app(make_config(max_body_bytes=2000)))
    ops = [insert(f"node-{i}") for i in range(100)]
    problem = await post_ops(client, ops, status=413)
    assert problem["code"] == "body_too_large"
    assert (await get_ops(client))["clock"] == 0


async def test_a_websocket_frame_too_large_closes_with_1009_and_applies_nothing(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    client = await aiohttp_client(create_app(make_config(max_ws_frame_bytes=1000)))
    ws = await client.ws_connect("/v1/workspaces/ws1/socket", headers=auth("ws1"))
    ops = [insert(f"node-{i}") for i in range(100)]
    await ws.send_json({"type": "apply", "sub_doc": "tree", "req": 1, "ops": ops})
    msg = await ws.receive(timeout=5)
    assert msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.CLOSING)
    assert ws.close_code == 1009
    assert (await get_ops(client))["clock"] == 0


async def test_bad_websocket_frames_get_error_frames_and_the_socket_stays_usable(
    client: TestClient[Any, Any],
) -> None:
    ws = await client.ws_connect("/v1/workspaces/ws1/socket", headers=auth("ws1"))
    await ws.send_str("{nope")
    assert (await ws.receive_json(timeout=5))["code"] == "malformed_json"
    await ws.send_json({"type": "apply", "sub_doc": "tree", "req": 7, "ops": [{"type": "x"}]})
    error = await ws.receive_json(timeout=5)
    assert (error["code"], error["req"], error["op_index"]) == ("unknown_op_type", 7, 0)
    await ws.send_json({"type": "dance", "sub_doc": "tree"})
    assert (await ws.receive_json(timeout=5))["code"] == "unknown_message_type"
    await ws.send_json({"type": "dance"})  # an unknown type is that, whatever else is missing
    assert (await ws.receive_json(timeout=5))["code"] == "unknown_message_type"
    await ws.send_json({"type": "apply", "sub_doc": "tree", "req": 8, "ops": [insert("a")]})
    ack = await ws.receive_json(timeout=5)
    assert ack == {
        "type": "ack",
        "req": 8,
        "results": [{"op_id": None, "clock": 1, "duplicate": False}],
    }
    await ws.close()


async def test_an_apply_of_no_ops_is_refused_over_http_and_the_websocket_alike(
    client: TestClient[Any, Any],
) -> None:
    problem = await post_ops(client, [], status=422)
    assert problem["code"] == "invalid_field"
    ws = await client.ws_connect("/v1/workspaces/ws1/socket", headers=auth("ws1"))
    await ws.send_json({"type": "apply", "sub_doc": "tree", "req": 3, "ops": []})
    error = await ws.receive_json(timeout=5)
    assert (error["type"], error["code"], error["req"]) == ("error", "invalid_field", 3)
    await ws.close()
    assert (await get_ops(client))["clock"] == 0


async def test_unknown_routes_answer_problem_json(client: TestClient[Any, Any]) -> None:
    resp = await client.get("/v1/nothing-here")
    assert resp.status == 404
    assert (await resp.json(content_type=None))["code"] == "not_found"
