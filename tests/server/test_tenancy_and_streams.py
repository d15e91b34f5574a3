"""Tenancy, tokens, idempotency keys, blobs and request streams through a real server on loopback,
on both backends: what one tenant may touch, what a hostile token gets, and that waiters of
abandoned streams are released."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.auth import mint_token
from cv_server.keys import STORES, WAITERS
from cv_server.queue import request_fingerprint
from tests.server.conftest import SECRET, ClientFactory, auth, token_for


@pytest.fixture
async def server(
    aiohttp_client: ClientFactory, make_server_config: Callable[..., ServerConfig]
) -> TestClient[Any, Any]:
    return await aiohttp_client(create_app(make_server_config()))


async def _enqueue(
    client: TestClient[Any, Any],
    body: dict[str, Any],
    *,
    workspace: str = "ws1",
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    resp = await client.post(
        f"/v1/workspaces/{workspace}/requests",
        json=body,
        headers={**auth(workspace), **(headers or {})},
    )
    return resp.status, await resp.json(content_type=None)


async def _claim(client: TestClient[Any, Any], workspace: str = "ws1") -> Any:
    resp = await client.post(
        "/v1/queue/claim", json={"worker_classes": ["evaluate"]}, headers=auth(workspace)
    )
    if resp.status == 204:
        return None
    assert resp.status == 200, await resp.text()
    return (await resp.json())["request"]


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


# -- request streams (SSE) -------------------------------------------------------------------------


@pytest.fixture
async def production_server(
    make_server_config: Callable[..., ServerConfig],
) -> AsyncIterator[tuple[str, web.Application]]:
    """The app served the way `cv-server serve` serves it (`web.AppRunner`, whose handlers are
    *not* cancelled when their client hangs up, unlike the test server's); sweeps shrunk."""
    app = create_app(make_server_config(sweep_seconds=0.1))
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        await runner.cleanup()


async def _until(condition: Callable[[], bool], patience: float = 30.0) -> None:
    """Wait for a state (not for time): poll `condition` until true, fail after `patience`
    (half the waiters' 60 s deadline: what a sweep must beat)."""
    async with asyncio.timeout(patience):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def test_streams_abandoned_by_their_clients_release_their_waiters_before_the_deadline(
    production_server: tuple[str, web.Application],
) -> None:
    base, app = production_server
    headers = auth("ws1")
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            f"{base}/v1/workspaces/ws1/requests",
            json={"stage": "evaluate", "job_id": "J"},
            headers=headers,
        )
        stream_url = base + (await resp.json())["stream_url"]
    for _ in range(20):  # each on its own connection, hung up after the first event
        async with aiohttp.ClientSession() as session:
            stream = await session.get(stream_url, headers=headers)  # default deadline: 60 s
            assert await stream.content.readline() == b"event: queued\n"
            stream.close()
    # The waiter was registered before the first event was written; with the client gone it
    # must be released at the next sweep, not 60 s later (a flapping client would otherwise
    # pile up deadline x reconnect-rate waiters, each re-reading its row every sweep).
    await _until(lambda: app[WAITERS].count == 0)


async def test_many_streams_on_one_request_all_get_its_outcome_and_release_their_waiters(
    server: TestClient[Any, Any],
) -> None:
    assert server.app is not None
    _, answer = await _enqueue(server, {"stage": "evaluate", "job_id": "many"})
    url = answer["stream_url"]

    async def events() -> list[str]:
        resp = await server.get(url, headers=auth("ws1"))
        return [
            line.split(": ", 1)[1]
            for line in (await resp.text()).splitlines()
            if line.startswith("event: ")
        ]

    streams = [asyncio.create_task(events()) for _ in range(40)]
    waiters = server.app[WAITERS]
    await _until(lambda: waiters.count == 40)  # every stream registered before the outcome
    row = await _claim(server)
    resp = await server.post(
        f"/v1/workspaces/ws1/requests/{row['request_id']}/complete",
        json={"claim_token": row["claim_token"], "result": 1},
        headers=auth("ws1"),
    )
    assert resp.status == 200
    async with asyncio.timeout(10):
        outcomes = await asyncio.gather(*streams)
    assert outcomes == [["queued", "done"]] * 40
    assert waiters.count == 0


async def test_a_request_of_one_workspace_is_not_found_under_another_on_any_route(
    server: TestClient[Any, Any],
) -> None:
    """ws2's token on ws2's paths naming ws1's request id: nothing found, nothing changed."""
    _, answer = await _enqueue(server, {"stage": "evaluate", "job_id": "J"})
    row = await _claim(server)
    request_id, claim_token = answer["request_id"], row["claim_token"]
    base = f"/v1/workspaces/ws2/requests/{request_id}"
    for method, path, body in [
        ("GET", base, None),
        ("GET", f"{base}/stream", None),
        ("POST", f"{base}/heartbeat", {"claim_token": claim_token}),
        ("POST", f"{base}/complete", {"claim_token": claim_token, "result": "stolen"}),
        ("POST", f"{base}/fail", {"claim_token": claim_token}),
        ("POST", f"{base}/replay", None),
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
    _, answer = await _enqueue(server, {"stage": "evaluate", "job_id": "J"})
    row = await _claim(server)
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
    await _enqueue(server, {"stage": "evaluate", "job_id": "J"})
    prefix = mint_token(SECRET, ["ws1"], now=time.time()).split(".")[0]

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    body = b64(json.dumps({"ws": [], "iat": int(time.time())}).encode())
    signed = f"{prefix}.{body}"
    token = f"{signed}.{b64(hmac.new(SECRET, signed.encode(), hashlib.sha256).digest())}"
    headers = {"Authorization": f"Bearer {token}"}
    claim = await server.post(
        "/v1/queue/claim", json={"worker_classes": ["evaluate"]}, headers=headers
    )
    assert claim.status == 204
    listing = await server.get("/v1/queue/requests", headers=headers)
    assert listing.status == 403
    doc = await server.get("/v1/workspaces/ws1/docs/tree", headers=headers)
    assert doc.status == 403
    ws = await server.ws_connect("/v1/workspaces/ws1/socket", headers=headers)
    await ws.receive(timeout=5)
    assert ws.close_code == 4003
    assert await _claim(server) is not None  # the work was left for a worker of ws1


async def test_an_invalid_workspace_id_on_the_socket_closes_4003_even_with_a_wildcard_token(
    server: TestClient[Any, Any],
) -> None:
    ws = await server.ws_connect("/v1/workspaces/bad%20id/socket", headers=auth("*"))
    await ws.receive(timeout=5)
    assert ws.close_code == 4003


# -- idempotency keys ------------------------------------------------------------------------------


async def test_one_idempotency_key_in_two_workspaces_names_two_independent_requests(
    server: TestClient[Any, Any],
) -> None:
    body = {"stage": "scrape", "input": {"url": "x"}}
    key = {"Idempotency-Key": "shared-key"}
    status1, first = await _enqueue(server, body, workspace="ws1", headers=key)
    status2, second = await _enqueue(server, body, workspace="ws2", headers=key)
    assert status1 == status2 == 202
    assert first["request_id"] != second["request_id"]
    assert second["stream_url"].startswith("/v1/workspaces/ws2/")
    # Each replay answers its own workspace's request, never the other's.
    for workspace, expected in (("ws1", first), ("ws2", second)):
        resp = await server.post(
            f"/v1/workspaces/{workspace}/requests", json=body, headers={**auth(workspace), **key}
        )
        assert resp.headers.get("Idempotency-Replayed") == "true"
        assert await resp.json() == expected
    # A reuse with another body is refused in the one workspace and leaves the other alone.
    _, refused = await _enqueue(
        server, {**body, "input": {"url": "y"}}, workspace="ws2", headers=key
    )
    assert refused["code"] == "idempotency_key_reuse"
    assert first["request_id"] not in str(refused)
    resp = await server.post(
        "/v1/workspaces/ws1/requests", json=body, headers={**auth("ws1"), **key}
    )
    assert await resp.json() == first


async def test_a_reused_key_is_refused_with_the_same_code_whatever_the_first_outcome(
    server: TestClient[Any, Any],
) -> None:
    """A key whose first request was refused (bad input, before the key was taken) stays free;
    one whose first request was accepted refuses a different body, never replaying its answer."""
    key = {"Idempotency-Key": "k2"}
    status, refused = await _enqueue(server, {"stage": ""}, headers=key)
    assert (status, refused["code"]) == (422, "invalid_field")
    status, accepted = await _enqueue(server, {"stage": "evaluate"}, headers=key)
    assert status == 202
    assert not accepted["coalesced"]
    for other in ({"stage": "evaluate", "input": 1}, {"stage": "other"}, {"stage": ""}):
        status, answer = await _enqueue(server, other, headers=key)
        if other == {"stage": ""}:  # invalid input is refused before the key is looked at
            assert (status, answer["code"]) == (422, "invalid_field")
            continue
        assert (status, answer["code"]) == (422, "idempotency_key_reuse")
        assert accepted["request_id"] not in str(answer)


async def test_a_key_whose_first_request_died_with_its_server_is_free_after_a_restart(
    aiohttp_client: ClientFactory,
    make_server_config: Callable[..., ServerConfig],
) -> None:
    """A crashed request must not leave `in_progress` behind (24 h of 409)."""
    raw = b'{"stage": "scrape", "input": {"url": "x"}}'
    path = "/v1/workspaces/ws1/requests"
    first = await aiohttp_client(create_app(make_server_config()))
    assert first.app is not None
    # The server took the key (committed) and died before its enqueue committed.
    fingerprint = request_fingerprint("POST", path, raw)
    await first.app[STORES].idempotency.begin("ws1", "k-crash", fingerprint, time.time())
    await first.close()
    restarted = await aiohttp_client(create_app(make_server_config()))
    headers = {**auth("ws1"), "Idempotency-Key": "k-crash", "Content-Type": "application/json"}
    resp = await restarted.post(path, data=raw, headers=headers)
    assert resp.status == 202, await resp.text()


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
    _, answer = await _enqueue(server, {"stage": "evaluate", "job_id": "J"})
    row = await _claim(server)
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
    await _enqueue(server, {"stage": "evaluate", "job_id": "J"})
    resp = await server.get(
        "/v1/queue/requests", params={"workspace": "ws1", "limit": "-1"}, headers=auth("ws1")
    )
    assert resp.status == 422, await resp.text()
    assert (await resp.json(content_type=None))["code"] == "invalid_field"
    listed = await server.get(
        "/v1/queue/requests", params={"workspace": "ws1", "limit": "1"}, headers=auth("ws1")
    )
    assert len((await listed.json())["requests"]) == 1
