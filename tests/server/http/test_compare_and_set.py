"""Compare-and-set through real HTTP and the websocket, on both backends (docs/ops.md#conflicts):
a stale `if_clock` is a 409 `version_conflict` problem (an `error` frame on the socket) carrying
the head clock, with nothing applied; a retry of a batch that committed is a duplicate."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from cv_mutations import new_op_id
from tests.server.conftest import auth
from tests.server.helpers import WS, counter, get_doc, get_ops, increment, insert

SOCKET = f"/v1/workspaces/{WS}/socket"
OPS = f"/v1/workspaces/{WS}/docs/tree/ops"


async def post(client: TestClient[Any, Any], body: dict[str, Any]) -> tuple[int, Any]:
    resp = await client.post(OPS, json=body, headers=auth(WS))
    return resp.status, await resp.json(content_type=None)


async def test_an_apply_based_on_the_head_commits(server: TestClient[Any, Any]) -> None:
    status, answer = await post(server, {"ops": [insert("n")], "if_clock": 0})
    assert status == 200, answer
    assert answer["results"][0]["clock"] == 1


async def test_a_stale_if_clock_is_a_409_with_the_head_and_nothing_applied(
    server: TestClient[Any, Any],
) -> None:
    await post(server, {"ops": [insert("n"), increment()]})
    status, problem = await post(server, {"ops": [increment(), increment()], "if_clock": 1})
    assert status == 409, problem
    assert problem["code"] == "version_conflict"
    assert problem["clock"] == 2
    assert [r["error"]["code"] for r in problem["results"]] == ["version_conflict"] * 2
    assert (await get_doc(server))["clock"] == 2
    assert await counter(server) == 1
    assert len((await get_ops(server))["ops"]) == 2


async def test_a_retry_of_a_committed_conditional_apply_is_a_duplicate(
    server: TestClient[Any, Any],
) -> None:
    body = {"ops": [insert("n", op_id=new_op_id()), increment()], "if_clock": 0}
    await post(server, body)
    status, answer = await post(server, body)
    assert status == 200, answer
    assert [(r["clock"], r["duplicate"]) for r in answer["results"]] == [(1, True), (2, True)]


@pytest.mark.parametrize(
    "if_clock", [-1, "3", 1.5, True, None, 2**62 + 1], ids=lambda v: repr(v)[:12]
)
async def test_a_bad_if_clock_is_refused_422_and_nothing_applied(
    server: TestClient[Any, Any], if_clock: object
) -> None:
    status, problem = await post(server, {"ops": [insert("n")], "if_clock": if_clock})
    if if_clock is None:  # JSON null: the member left out
        assert status == 200, problem
        return
    assert status == 422, problem
    assert problem["code"] == "invalid_field"
    assert (await get_doc(server))["clock"] == 0


async def test_racing_conditional_applies_on_one_clock_commit_one(
    server: TestClient[Any, Any],
) -> None:
    await post(server, {"ops": [insert("n")]})
    answers = await asyncio.gather(
        *(post(server, {"ops": [increment()], "if_clock": 1}) for _ in range(10))
    )
    assert sorted(status for status, _ in answers) == [200] + [409] * 9
    assert await counter(server) == 1


async def test_a_socket_apply_on_a_stale_clock_gets_an_error_frame_with_the_head(
    server: TestClient[Any, Any],
) -> None:
    await post(server, {"ops": [insert("n")]})
    ws = await server.ws_connect(SOCKET, headers=auth(WS))
    stale = {"type": "apply", "sub_doc": "tree", "req": 1, "ops": [increment()], "if_clock": 0}
    fresh = {"type": "apply", "sub_doc": "tree", "req": 2, "ops": [increment()], "if_clock": 1}
    await ws.send_json(stale)
    await ws.send_json(fresh)
    async with asyncio.timeout(10):
        first, second = await ws.receive_json(), await ws.receive_json()
    assert first["type"] == "error"
    assert (first["req"], first["code"], first["clock"]) == (1, "version_conflict", 1)
    assert (second["type"], second["req"]) == ("ack", 2)
    assert second["results"][0]["clock"] == 2
    await ws.close()
    assert await counter(server) == 1
