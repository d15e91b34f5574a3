"""Values a PostgreSQL column cannot hold (NUL in text, a negative LIMIT), sent to every route
that takes one, on both backends: refused (422) or not found (404), never a server error, though
SQLite would have stored them."""

from __future__ import annotations

from typing import Any

from aiohttp.test_utils import TestClient

from tests.server.conftest import auth
from tests.server.helpers import claim, enqueue

# -- NUL and other values a PostgreSQL text column cannot hold -------------------------------------


async def test_nul_in_ids_and_names_is_refused_or_not_found_never_a_server_error(
    server: TestClient[Any, Any],
) -> None:
    """SQLite stores NUL; PostgreSQL text refuses it, which was a 500 on that backend only."""
    h = auth("ws1")
    for method, path, body, expected in [
        ("GET", "/v1/workspaces/ws1/requests/r_%00", None, 404),
        ("GET", "/v1/workspaces/ws1/requests/r_%00/stream", None, 404),
        ("POST", "/v1/workspaces/ws1/requests/r_%00/complete", {"claim_token": "t"}, 404),
        ("GET", "/v1/workspaces/ws1/blobs/b_%00", None, 404),
        ("POST", "/v1/workspaces/ws1/requests", {"stage": "s\u0000"}, 422),
        ("POST", "/v1/workspaces/ws1/requests", {"stage": "s", "job_id": "j\u0000"}, 422),
        ("POST", "/v1/queue/claim", {"worker_classes": ["a\u0000"]}, 422),
        ("POST", "/v1/queue/claim", {"worker_classes": ["a"], "worker_id": "\u0000"}, 422),
        (
            "POST",
            "/v1/queue/complete",
            {"completions": [{"request_id": "r\u0000", "claim_token": "t"}]},
            422,
        ),
        ("POST", "/v1/workspaces/ws1/locks/acquire", {"job_id": "j\u0000", "task": "t"}, 422),
        (
            "POST",
            "/v1/workspaces/ws1/locks/acquire",
            {"job_id": "j", "task": "t", "holder": "\u0000"},
            422,
        ),
        (
            "POST",
            "/v1/workspaces/ws1/locks/release",
            {"job_id": "j", "task": "t", "token": "\u0000"},
            422,
        ),
    ]:
        resp = await server.request(method, path, json=body, headers=h)
        assert resp.status == expected, (method, path, body, await resp.text())
    # A real claim token with a NUL appended is refused, and the holder keeps its lease.
    _, answer = await enqueue(server, {"stage": "evaluate", "job_id": "J"})
    row = await claim(server)
    base = f"/v1/workspaces/ws1/requests/{answer['request_id']}"
    for verb in ("heartbeat", "complete", "fail"):
        resp = await server.post(
            f"{base}/{verb}", json={"claim_token": row["claim_token"] + "\u0000"}, headers=h
        )
        assert resp.status == 422, (verb, await resp.text())
    resp = await server.post(
        f"{base}/heartbeat", json={"claim_token": row["claim_token"]}, headers=h
    )
    assert resp.status == 200


async def test_a_negative_listing_limit_is_refused_not_a_server_error(
    server: TestClient[Any, Any],
) -> None:
    await enqueue(server, {"stage": "evaluate", "job_id": "J"})
    resp = await server.get(
        "/v1/queue/requests", params={"workspace": "ws1", "limit": "-1"}, headers=auth("ws1")
    )
    assert resp.status == 422, await resp.text()
    assert (await resp.json(content_type=None))["code"] == "invalid_field"
    listed = await server.get(
        "/v1/queue/requests", params={"workspace": "ws1", "limit": "1"}, headers=auth("ws1")
    )
    assert len((await listed.json())["requests"]) == 1
