"""The worker channel (`GET /v1/queue/channel`, docs/protocol.md "The worker channel") through a
real server on loopback, on SQLite and PostgreSQL: slots offered are filled by claims pushed as
work arrives, reports are fenced by their claim token exactly as the HTTP verbs are, and hostile
frames get error frames with stable codes while the channel and the server stay up."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from cv_server.auth import mint_token
from tests.server.conftest import SECRET, auth, token_for

WS = "ws1"
OTHER = "ws2"
CHANNEL = "/v1/queue/channel"
BOUND = 10.0

Client = TestClient[Any, Any]


async def _frame(ws: aiohttp.ClientWebSocketResponse) -> dict[str, Any]:
    """The next frame (the server may batch frames into a JSON array)."""
    pending: list[dict[str, Any]] = getattr(ws, "_cv_pending", [])
    if not pending:
        msg = await ws.receive(timeout=BOUND)
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        body = msg.json()
        pending = body if isinstance(body, list) else [body]
    frame = pending.pop(0)
    ws._cv_pending = pending  # type: ignore[attr-defined]
    return frame


async def _open(client: Client, *workspaces: str, slots: int = 0) -> Any:
    ws = await client.ws_connect(CHANNEL, headers=auth(*(workspaces or (WS,))))
    await ws.send_json({"type": "hello", "worker_classes": ["s"], "worker_id": "w", "slots": slots})
    assert (await _frame(ws))["type"] == "welcome"
    return ws


async def _enqueue(client: Client, job: str, workspace: str = WS) -> str:
    r = await client.post(
        f"/v1/workspaces/{workspace}/requests",
        json={"stage": "s", "job_id": job},
        headers=auth(workspace),
    )
    assert r.status == 202, await r.text()
    return str((await r.json())["request_id"])


async def _row(client: Client, request_id: str, workspace: str = WS) -> dict[str, Any]:
    r = await client.get(
        f"/v1/workspaces/{workspace}/requests/{request_id}", headers=auth(workspace)
    )
    assert r.status == 200
    return dict(await r.json())


async def _claimed(ws: Any) -> list[dict[str, Any]]:
    frame = await _frame(ws)
    assert frame["type"] == "claimed", frame
    return list(frame["requests"])


async def test_an_offered_slot_is_filled_when_work_arrives_and_a_completion_claims_the_next(
    server: Client,
) -> None:
    ws = await _open(server, slots=1)
    first = await _enqueue(server, "J1")  # the push wakes the channel's claim
    (row,) = await _claimed(ws)
    assert row["request_id"] == first
    second = await _enqueue(server, "J2")
    completion = {"request_id": first, "claim_token": row["claim_token"], "result": 1}
    await ws.send_json({"type": "complete", "id": 1, "completions": [completion], "free": 1})
    answer = await _frame(ws)
    assert answer["type"] == "answer"
    assert answer["id"] == 1
    assert answer["results"] == [{"request_id": first, "status": "done"}]
    # The slot the completion freed was claimed in its commit: the next row rides the answer.
    assert [r["request_id"] for r in answer["claimed"]] == [second]
    assert (await _row(server, first))["status"] == "done"
    assert (await _row(server, second))["status"] == "in_progress"
    await ws.close()


async def test_reports_are_fenced_by_their_claim_token_as_the_http_verbs_are(
    server: Client,
) -> None:
    ws = await _open(server, slots=1)
    rid = await _enqueue(server, "J1")
    (row,) = await _claimed(ws)
    stale = {"request_id": rid, "claim_token": "not-the-token"}
    await ws.send_json({"type": "heartbeat", "id": "h", **stale})
    await ws.send_json({"type": "complete", "id": "c", "completions": [{**stale, "result": 1}]})
    await ws.send_json({"type": "fail", "id": "f", **stale, "error": {"code": "x"}})
    heartbeat, complete, fail = [await _frame(ws) for _ in range(3)]
    assert heartbeat["error"]["code"] == "lease_lost"
    assert complete["results"][0]["error"]["code"] == "lease_lost"
    assert fail["error"]["code"] == "lease_lost"
    after = await _row(server, rid)
    assert (after["status"], after["dequeue_count"]) == ("in_progress", 1)
    await ws.send_json(
        {"type": "heartbeat", "id": "ok", "request_id": rid, "claim_token": row["claim_token"]}
    )
    assert (await _frame(ws))["lease_expires_at"] >= row["lease_expires_at"]
    await ws.close()


async def test_a_cancel_reaches_the_holder_at_its_next_heartbeat_and_its_fail_ends_it_cancelled(
    server: Client,
) -> None:
    ws = await _open(server, slots=1)
    rid = await _enqueue(server, "J1")
    (row,) = await _claimed(ws)
    r = await server.post(f"/v1/workspaces/{WS}/requests/{rid}/cancel", headers=auth(WS))
    assert r.status == 200
    held = {"request_id": rid, "claim_token": row["claim_token"]}
    await ws.send_json({"type": "heartbeat", "id": 1, **held})
    assert (await _frame(ws))["error"]["code"] == "cancelled"
    await ws.send_json({"type": "fail", "id": 2, **held, "error": {"code": "cancelled"}})
    assert (await _frame(ws))["status"] == "cancelled"
    assert (await _row(server, rid))["status"] == "cancelled"
    await ws.close()


async def test_a_request_of_a_workspace_outside_the_grant_is_refused_and_left_alone(
    server: Client,
) -> None:
    theirs = await _enqueue(server, "J1", OTHER)
    other = await _open(server, OTHER, slots=1)
    (row,) = await _claimed(other)
    mine = await _open(server, WS)
    held = {"request_id": theirs, "claim_token": row["claim_token"]}
    await mine.send_json({"type": "complete", "id": 1, "completions": [{**held, "result": 1}]})
    await mine.send_json({"type": "heartbeat", "id": 2, **held})
    await mine.send_json({"type": "fail", "id": 3, **held, "error": None})
    for frame_id in (1, 2, 3):
        refused = await _frame(mine)
        assert (refused["type"], refused["code"], refused["id"]) == (
            "error",
            "forbidden_workspace",
            frame_id,
        )
    assert (await _row(server, theirs, OTHER))["status"] == "in_progress"
    # Nor is it ever handed to a channel whose token does not grant its workspace.
    await mine.send_json({"type": "free", "slots": 1})
    await mine.send_json({"type": "drain", "id": "d"})
    assert await _frame(mine) == {"type": "answer", "id": "d"}
    await mine.close()
    await other.close()


@pytest.mark.parametrize(
    ("sent", "code"),
    [
        ("{not json", "malformed_json"),
        ("[1]", "malformed_json"),
        ('{"type": "claim"}', "unknown_message_type"),
        ('{"kind": "complete"}', "unknown_message_type"),
        ('{"type": "free", "slots": 0}', "invalid_field"),
        ('{"type": "free", "slots": 100000}', "invalid_field"),
        ('{"type": "heartbeat", "id": {"a": 1}}', "invalid_field"),
        ('{"type": "heartbeat", "id": 1, "request_id": "r\\u0000", "claim_token": "t"}', None),
        ('{"type": "complete", "id": 1, "completions": []}', "invalid_field"),
        ('{"type": "complete", "id": 1, "completions": [{"request_id": "r"}]}', "invalid_field"),
        ('{"type": "fail", "id": 1, "request_id": "r", "claim_token": "t", "free": -1}', None),
    ],
)
async def test_a_hostile_frame_gets_an_error_frame_and_the_channel_serves_on(
    server: Client, sent: str, code: str | None
) -> None:
    ws = await _open(server)
    await ws.send_str(sent)
    refused = await _frame(ws)
    assert refused["type"] == "error"
    assert refused["code"] == (code or "invalid_field")
    rid = await _enqueue(server, "J1")
    await ws.send_json({"type": "free", "slots": 1})
    assert [r["request_id"] for r in await _claimed(ws)] == [rid]
    await ws.close()


async def test_a_result_nested_past_what_the_store_keeps_is_refused_whole(server: Client) -> None:
    ws = await _open(server, slots=1)
    rid = await _enqueue(server, "J1")
    (row,) = await _claimed(ws)
    deep: Any = 1
    for _ in range(300):
        deep = [deep]
    good = {"request_id": rid, "claim_token": row["claim_token"], "result": 1}
    bad = {**good, "result": deep}
    await ws.send_json({"type": "complete", "id": 1, "completions": [good, bad]})
    refused = await _frame(ws)
    assert (refused["code"], refused["id"], refused["item_index"]) == ("invalid_field", 1, 1)
    assert (await _row(server, rid))["status"] == "in_progress"  # nothing of it applied
    await ws.close()


async def test_the_first_frame_must_be_a_hello_and_a_bad_one_may_be_sent_again(
    server: Client,
) -> None:
    ws = await server.ws_connect(CHANNEL, headers=auth(WS))
    await ws.send_json({"type": "free", "slots": 1})
    assert (await _frame(ws))["code"] == "unknown_message_type"
    await ws.send_json({"type": "hello", "worker_classes": []})
    assert (await _frame(ws))["code"] == "invalid_field"
    await ws.send_json({"type": "hello", "worker_classes": ["s"]})
    assert (await _frame(ws))["type"] == "welcome"
    await ws.close()


async def test_the_handshake_needs_a_token_with_the_work_scope(server: Client) -> None:
    with pytest.raises(aiohttp.WSServerHandshakeError) as anonymous:
        await server.ws_connect(CHANNEL)
    assert anonymous.value.status == 401
    enqueuer = mint_token(SECRET, [WS], now=time.time(), scopes=["enqueue"])
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await server.ws_connect(CHANNEL, headers={"Authorization": f"Bearer {enqueuer}"})
    assert refused.value.status == 403
    # A token may come as the `cv-bearer.<token>` subprotocol instead of a header.
    ws = await server.ws_connect(CHANNEL, protocols=("cv-worker.v1", f"cv-bearer.{token_for(WS)}"))
    assert ws.protocol == "cv-worker.v1"
    await ws.send_json({"type": "hello", "worker_classes": ["s"]})
    assert (await _frame(ws))["type"] == "welcome"
    await ws.close()


async def test_an_idle_channel_writes_no_log_line(
    server: Client, caplog: pytest.LogCaptureFixture
) -> None:
    ws = await _open(server, slots=4)
    caplog.clear()
    with caplog.at_level("DEBUG"):
        await ws.send_json({"type": "drain", "id": 1})  # a round trip after some idling
        assert (await _frame(ws))["type"] == "answer"
    # The scheduler's one line when it takes its lease at start is its own, not the channel's.
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("cv_server") and r.name != "cv_server.schedules.firing"
    ]
    assert lines == []
    await ws.close()
