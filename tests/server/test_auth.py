"""Tokens: another workspace's data is refused on every route and on the socket."""

from __future__ import annotations

import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

import cv_server.http.security
from cv_server.auth import TokenError, mint_token, verify_token
from tests.server.conftest import SECRET, auth
from tests.server.helpers import insert, post_ops

ROUTES = [
    ("POST", "/v1/workspaces/ws1/docs/tree/ops"),
    ("GET", "/v1/workspaces/ws1/docs/tree"),
    ("GET", "/v1/workspaces/ws1/docs/tree/ops"),
]


@pytest.mark.parametrize(("method", "path"), ROUTES)
async def test_a_token_for_another_workspace_is_refused(
    client: TestClient[Any, Any], method: str, path: str
) -> None:
    await post_ops(client, [insert("secret-node")])
    resp = await client.request(method, path, json={"ops": []}, headers=auth("ws2"))
    assert resp.status == 403
    body = await resp.json(content_type=None)
    assert body["code"] == "forbidden_workspace"
    assert "secret-node" not in await resp.text()


@pytest.mark.parametrize(("method", "path"), ROUTES)
async def test_no_token_or_a_forged_one_is_unauthorized(
    client: TestClient[Any, Any], method: str, path: str
) -> None:
    forged = mint_token(b"not-the-secret", ["ws1"], now=time.time())
    for headers in ({}, {"Authorization": f"Bearer {forged}"}, {"Authorization": "Bearer x.y"}):
        resp = await client.request(method, path, json={"ops": []}, headers=headers)
        assert resp.status == 401
        assert (await resp.json(content_type=None))["code"] == "unauthorized"


async def test_the_socket_refuses_another_workspace_with_4003(
    client: TestClient[Any, Any],
) -> None:
    ws = await client.ws_connect("/v1/workspaces/ws1/socket", headers=auth("ws2"))
    msg = await ws.receive(timeout=5)
    assert msg.data == 4003
    assert ws.close_code == 4003


async def test_the_socket_refuses_a_missing_token_with_4001(
    client: TestClient[Any, Any],
) -> None:
    ws = await client.ws_connect("/v1/workspaces/ws1/socket")
    await ws.receive(timeout=5)
    assert ws.close_code == 4001


async def test_the_socket_accepts_a_token_in_the_query_string(
    client: TestClient[Any, Any],
) -> None:
    token = auth("ws1")["Authorization"].split()[1]
    ws = await client.ws_connect(f"/v1/workspaces/ws1/socket?token={token}")
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
    assert await ws.receive_json(timeout=5) == {"type": "synced", "sub_doc": "tree", "clock": 0}
    await ws.close()


async def test_a_wildcard_token_grants_every_workspace(client: TestClient[Any, Any]) -> None:
    resp = await client.get("/v1/workspaces/any/docs/tree", headers=auth("*"))
    assert resp.status == 200


def test_an_expired_token_is_refused() -> None:
    token = mint_token(SECRET, ["ws1"], now=1000.0, ttl=60)
    assert verify_token(SECRET, token, now=1059.0).allows("ws1")
    with pytest.raises(TokenError, match="expired"):
        verify_token(SECRET, token, now=1060.0)


def test_a_tampered_payload_is_refused() -> None:
    token = mint_token(SECRET, ["ws1"], now=1000.0)
    other = mint_token(SECRET, ["ws2"], now=1000.0)
    spliced = ".".join([token.split(".")[0], other.split(".")[1], token.split(".")[2]])
    with pytest.raises(TokenError, match="signature"):
        verify_token(SECRET, spliced, now=1000.0)


async def test_an_expired_token_is_refused_by_the_server_even_after_it_was_accepted(
    client: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    now = time.time()
    token = mint_token(SECRET, ["ws1"], now=now, ttl=60)
    headers = {"Authorization": f"Bearer {token}"}
    assert (await client.get("/v1/workspaces/ws1/docs/tree", headers=headers)).status == 200
    # The verified token is cached now; move the server's clock past its expiry.
    monkeypatch.setattr(cv_server.http.security, "now", lambda: now + 61)
    resp = await client.get("/v1/workspaces/ws1/docs/tree", headers=headers)
    assert resp.status == 401
    assert "expired" in (await resp.json(content_type=None))["detail"]


def test_cli_overrides_accept_numeric_settings_and_refuse_others() -> None:
    from cv_server.cli import parse_overrides

    assert parse_overrides(["lease_seconds=5", "max_dequeues=3"]) == {
        "lease_seconds": 5.0,
        "max_dequeues": 3,
    }
    for bad in (["token_secret=x"], ["lease_seconds"], ["lease_seconds=soon"], ["nope=1"]):
        with pytest.raises(SystemExit):
            parse_overrides(bad)
