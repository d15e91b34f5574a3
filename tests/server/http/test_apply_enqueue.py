"""An apply's `enqueue` through real HTTP, on both backends
(docs/queue.md#start-work-with-the-change-that-needs-it): the ops and the requests commit in one
transaction or not at all; a resend enqueues nothing new and is answered with the same requests;
a bad item, a conflict or a rejected atomic batch leaves neither ops nor requests."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from cv_mutations import new_op_id
from cv_server.auth import mint_token
from tests.server.conftest import SECRET, auth
from tests.server.helpers import WS, counter, get_doc, get_ops, increment, insert

OPS = f"/v1/workspaces/{WS}/docs/tree/ops"
REQUESTS = f"/v1/workspaces/{WS}/requests"


async def post(
    client: TestClient[Any, Any], body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    resp = await client.post(OPS, json=body, headers=headers or auth(WS))
    return resp.status, await resp.json(content_type=None)


async def request_row(client: TestClient[Any, Any], request_id: str) -> tuple[int, Any]:
    resp = await client.get(f"{REQUESTS}/{request_id}", headers=auth(WS))
    return resp.status, await resp.json(content_type=None)


def scoped(*scopes: str) -> dict[str, str]:
    token = mint_token(SECRET, [WS], now=time.time(), ttl=600, scopes=list(scopes))
    return {"Authorization": f"Bearer {token}"}


async def test_the_ops_and_the_requests_commit_together(server: TestClient[Any, Any]) -> None:
    body = {
        "ops": [insert("n", op_id=new_op_id()), increment(op_id=new_op_id())],
        "enqueue": [{"stage": "evaluate", "input": {"x": 1}}, {"stage": "score", "job_id": "j1"}],
    }
    status, answer = await post(server, body)
    assert status == 200, answer
    assert [r["clock"] for r in answer["results"]] == [1, 2]
    assert [(e["status"], e["coalesced"]) for e in answer["enqueued"]] == [("pending", False)] * 2
    for item in answer["enqueued"]:
        status, row = await request_row(server, item["request_id"])
        assert status == 200, row
        assert row["caused_by_clock"] == 2
        assert row["status"] == "pending"


async def test_a_resend_enqueues_nothing_new_and_names_the_same_requests(
    server: TestClient[Any, Any],
) -> None:
    body = {"ops": [insert("n", op_id=new_op_id())], "enqueue": [{"stage": "evaluate"}]}
    _, first = await post(server, body)
    status, again = await post(server, body)
    assert status == 200, again
    assert again["results"][0]["duplicate"] is True
    assert [e["request_id"] for e in again["enqueued"]] == [
        e["request_id"] for e in first["enqueued"]
    ]
    assert again["enqueued"][0]["coalesced"] is True
    status, row = await request_row(server, first["enqueued"][0]["request_id"])
    assert (status, row["run"], row["caused_by_clock"]) == (200, 1, 1)
    assert (await get_doc(server))["clock"] == 1


async def test_a_conflict_leaves_neither_ops_nor_requests(server: TestClient[Any, Any]) -> None:
    await post(server, {"ops": [insert("n")]})
    body = {
        "ops": [increment(op_id=new_op_id())],
        "if_clock": 0,
        "enqueue": [{"stage": "evaluate", "job_id": "j-conflict"}],
    }
    status, problem = await post(server, body)
    assert status == 409, problem
    assert problem["code"] == "version_conflict"
    assert (await get_doc(server))["clock"] == 1
    status, answer = await post(
        server, {"ops": [increment()], "enqueue": [{"stage": "evaluate", "job_id": "j-conflict"}]}
    )
    # The same deterministic item after the conflict is a new request, not a coalesced one.
    assert answer["enqueued"][0]["coalesced"] is False


async def test_a_rejected_atomic_batch_leaves_neither_ops_nor_requests(
    server: TestClient[Any, Any],
) -> None:
    body = {
        "ops": [insert("n"), {"type": "node.delete", "node_id": "missing"}],
        "atomic": True,
        "enqueue": [{"stage": "evaluate", "job_id": "j-atomic"}],
    }
    status, answer = await post(server, body)
    assert status == 200, answer
    assert answer["enqueued"] == [
        {
            "request_id": answer["enqueued"][0]["request_id"],
            "status": None,
            "coalesced": False,
            "input_differs": False,
            "stream_url": None,
        }
    ]
    status, _ = await request_row(server, answer["enqueued"][0]["request_id"])
    assert status == 404
    assert (await get_doc(server))["clock"] == 0


@pytest.mark.parametrize(
    "enqueue",
    [
        [],
        {"stage": "evaluate"},
        [{"stage": ""}],
        [{"stage": "evaluate", "surprise": 1}],
        [{"stage": "evaluate"}, "not an object"],
        [{"stage": "evaluate"}] * 1001,
    ],
    ids=["empty", "not-a-list", "bad-stage", "unknown-member", "bad-second-item", "too-many"],
)
async def test_a_bad_item_is_422_and_nothing_applied(
    server: TestClient[Any, Any], enqueue: object
) -> None:
    status, problem = await post(server, {"ops": [insert("n")], "enqueue": enqueue})
    assert status == 422, problem
    assert problem["code"] == "invalid_field"
    assert (await get_doc(server))["clock"] == 0
    assert (await get_ops(server))["ops"] == []


async def test_enqueue_needs_the_enqueue_scope_besides_write(
    server: TestClient[Any, Any],
) -> None:
    body = {"ops": [insert("n")], "enqueue": [{"stage": "evaluate"}]}
    status, problem = await post(server, body, scoped("write"))
    assert status == 403, problem
    assert problem["code"] == "missing_scope"
    assert problem["required_scopes"] == ["enqueue"]
    assert (await get_doc(server))["clock"] == 0
    status, answer = await post(server, body, scoped("write", "enqueue"))
    assert status == 200, answer
    assert await counter(server) is None


async def test_a_socket_apply_with_enqueue_is_refused_and_nothing_applied(
    server: TestClient[Any, Any],
) -> None:
    ws = await server.ws_connect(f"/v1/workspaces/{WS}/socket", headers=auth(WS))
    frame = {
        "type": "apply",
        "sub_doc": "tree",
        "req": 1,
        "ops": [insert("n")],
        "enqueue": [{"stage": "evaluate"}],
    }
    await ws.send_json(frame)
    async with asyncio.timeout(10):
        answer = await ws.receive_json()
    assert (answer["type"], answer["req"], answer["code"]) == ("error", 1, "invalid_field")
    await ws.close()
    assert (await get_doc(server))["clock"] == 0
