"""Tenancy and tokens through a real server on loopback, on both backends: what one tenant may
touch on every route and on the socket, and what a hostile or malformed token gets (401, or the
socket closed with 4001 or 4003), never a server error."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time
from typing import Any

from aiohttp.test_utils import TestClient

from cv_server.auth import mint_token
from tests.server.conftest import SECRET, auth, token_for
from tests.server.helpers import claim, enqueue

# -- tokens ----------------------------------------------------------------------------------------


async def test_a_token_with_non_ascii_bytes_is_unauthorized_not_a_server_error(
    server: TestClient[Any, Any],
) -> None:
    good = token_for("ws1")
    for forged in (good[:-2] + "é", good.replace(".", ".é", 1), "cvt1.é.é"):
        resp = await server.get(
            "/v1/workspaces/ws1/docs/tree", headers={"Authorization": f"Bearer {forged}"}
        )
        assert resp.status == 401, await resp.text()
        assert (await resp.json(content_type=None))["code"] == "unauthorized"
        ws = await server.ws_connect("/v1/workspaces/ws1/socket", params={"token": forged})
        await ws.receive(timeout=5)
        assert ws.close_code == 4001


async def test_a_header_token_with_bytes_that_are_not_utf8_is_unauthorized(
    server: TestClient[Any, Any],
) -> None:
    # aiohttp decodes such header bytes with surrogateescape; signing them must not raise.
    host, port = server.server.host, server.server.port
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            b"GET /v1/workspaces/ws1/docs/tree HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Authorization: Bearer cvt1.\xff\xfe.abc\r\n\r\n"
        )
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()
    assert status_line.split()[1] == b"401", status_line


async def test_a_request_of_one_workspace_is_not_found_under_another_on_any_route(
    server: TestClient[Any, Any],
) -> None:
    """ws2's token on ws2's paths naming ws1's request id: nothing found, nothing changed."""
    _, answer = await enqueue(server, {"stage": "evaluate", "job_id": "J"})
    row = await claim(server)
    request_id, claim_token = answer["request_id"], row["claim_token"]
    base = f"/v1/workspaces/ws2/requests/{request_id}"
    for method, path, body in [
        ("GET", base, None),
        ("GET", f"{base}/stream", None),
        ("POST", f"{base}/heartbeat", {"claim_token": claim_token}),
        ("POST", f"{base}/complete", {"claim_token": claim_token, "result": "stolen"}),
        ("POST", f"{base}/fail", {"claim_token": claim_token}),
        ("POST", f"{base}/replay", None),
        ("POST", f"{base}/discard", None),
    ]:
        resp = await server.request(method, path, json=body, headers=auth("ws2"))
        assert resp.status == 404, (path, await resp.text())
        assert (await resp.json(content_type=None))["code"] == "not_found"
    got = await server.get(f"/v1/workspaces/ws1/requests/{request_id}", headers=auth("ws1"))
    assert (await got.json())["status"] == "in_progress"
    assert (await got.json())["result"] is None


async def test_a_token_for_another_workspace_touches_nothing_on_any_queue_lock_or_blob_route(
    server: TestClient[Any, Any],
) -> None:
    _, answer = await enqueue(server, {"stage": "evaluate", "job_id": "J"})
    row = await claim(server)
    request_id, claim_token = answer["request_id"], row["claim_token"]
    base = f"/v1/workspaces/ws1/requests/{request_id}"
    lock = {"job_id": "J", "task": "t"}
    cases: list[tuple[str, str, Any, dict[str, str]]] = [
        ("POST", "/v1/workspaces/ws1/requests", {"stage": "evaluate"}, {}),
        ("POST", "/v1/workspaces/ws1/requests", {"stage": "evaluate"}, {"Idempotency-Key": "k"}),
        ("GET", base, None, {}),
        ("GET", f"{base}/stream", None, {}),
        ("POST", f"{base}/heartbeat", {"claim_token": claim_token}, {}),
        ("POST", f"{base}/complete", {"claim_token": claim_token, "result": "x"}, {}),
        ("POST", f"{base}/fail", {"claim_token": claim_token}, {}),
        ("POST", f"{base}/replay", None, {}),
        ("POST", f"{base}/discard", None, {}),
        ("GET", "/v1/workspaces/ws1/blobs/b_00", None, {}),
        ("POST", "/v1/workspaces/ws1/locks/acquire", lock, {}),
        ("POST", "/v1/workspaces/ws1/locks/release", {**lock, "token": "t"}, {}),
        ("GET", "/v1/queue/requests?workspace=ws1", None, {}),
        ("GET", "/v1/queue/requests", None, {}),  # no workspace named: only "*" may list all
        (
            "POST",
            "/v1/queue/complete",
            {"completions": [{"request_id": request_id, "claim_token": claim_token}]},
            {},
        ),
    ]
    for method, path, body, extra in cases:
        resp = await server.request(method, path, json=body, headers={**auth("ws2"), **extra})
        assert resp.status == 403, (method, path, await resp.text())
        assert (await resp.json(content_type=None))["code"] == "forbidden_workspace"
    # Nothing moved: the holder still holds its lease and the lock is still free.
    heartbeat = await server.post(
        f"{base}/heartbeat", json={"claim_token": claim_token}, headers=auth("ws1")
    )
    assert heartbeat.status == 200
    acquired = await server.post("/v1/workspaces/ws1/locks/acquire", json=lock, headers=auth("ws1"))
    assert (await acquired.json())["acquired"] is True
    listed = await server.get("/v1/queue/requests?workspace=ws1", headers=auth("ws1"))
    assert [r["request_id"] for r in (await listed.json())["requests"]] == [request_id]


async def test_a_token_naming_no_workspace_may_touch_none(server: TestClient[Any, Any]) -> None:
    # `mint_token` refuses an empty list, but a signed payload may still carry one.
    assert server.app is not None
    await enqueue(server, {"stage": "evaluate", "job_id": "J"})
    prefix = mint_token(SECRET, ["ws1"], now=time.time()).split(".")[0]

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    body = b64(json.dumps({"ws": [], "iat": int(time.time())}).encode())
    signed = f"{prefix}.{body}"
    token = f"{signed}.{b64(hmac.new(SECRET, signed.encode(), hashlib.sha256).digest())}"
    headers = {"Authorization": f"Bearer {token}"}
    claimed = await server.post(
        "/v1/queue/claim", json={"worker_classes": ["evaluate"]}, headers=headers
    )
    assert claimed.status == 204
    listing = await server.get("/v1/queue/requests", headers=headers)
    assert listing.status == 403
    doc = await server.get("/v1/workspaces/ws1/docs/tree", headers=headers)
    assert doc.status == 403
    ws = await server.ws_connect("/v1/workspaces/ws1/socket", headers=headers)
    await ws.receive(timeout=5)
    assert ws.close_code == 4003
    assert await claim(server) is not None  # the work was left for a worker of ws1


async def test_an_invalid_workspace_id_on_the_socket_closes_4003_even_with_a_wildcard_token(
    server: TestClient[Any, Any],
) -> None:
    ws = await server.ws_connect("/v1/workspaces/bad%20id/socket", headers=auth("*"))
    await ws.receive(timeout=5)
    assert ws.close_code == 4003


async def test_the_scheme_is_case_insensitive_and_bad_tokens_get_401_and_close_4001(
    server: TestClient[Any, Any],
) -> None:
    good = token_for("ws1")
    for scheme in ("Bearer", "bearer", "BEARER"):
        resp = await server.get(
            "/v1/workspaces/ws1/docs/tree", headers={"Authorization": f"{scheme} {good}"}
        )
        assert resp.status == 200
    expired = mint_token(SECRET, ["ws1"], now=time.time() - 120, ttl=60)
    forged = mint_token(b"another-secret-of-another-server", ["ws1"], now=time.time())
    bad = [expired, forged, good[:-1], good.rsplit(".", 1)[0], good + "A", "", "cvt1..", "x" * 300]
    for token in bad:
        for value in (f"Bearer {token}", f"Basic {good}", good):
            resp = await server.get(
                "/v1/workspaces/ws1/docs/tree", headers={"Authorization": value}
            )
            assert resp.status == 401, (value, await resp.text())
            assert (await resp.json(content_type=None))["code"] == "unauthorized"
        ws = await server.ws_connect("/v1/workspaces/ws1/socket", params={"token": token})
        await ws.receive(timeout=5)
        assert ws.close_code == 4001, token
