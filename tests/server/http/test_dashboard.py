"""The dashboard's server side: its page and files (public, self-contained, under a strict
Content-Security-Policy), and the browser's way onto the websocket, the token passed as the
`cv-bearer.<token>` subprotocol, never in the URL. The page in a real browser: tests/browser."""

from __future__ import annotations

import re
from typing import Any

import pytest
from aiohttp import WSMsgType
from aiohttp.test_utils import TestClient

from cv_server.http.dashboard import ASSETS
from cv_server.http.security import BEARER_SUBPROTOCOL_PREFIX, SOCKET_SUBPROTOCOL
from tests.server.conftest import token_for
from tests.server.helpers import insert, post_ops

SOCKET = "/v1/workspaces/ws1/socket"


async def test_the_page_is_served_without_a_token_under_a_strict_policy(
    client: TestClient[Any, Any],
) -> None:
    resp = await client.get("/dashboard")
    assert resp.status == 200
    assert resp.content_type == "text/html"
    page = await resp.text()
    assert '<script src="/dashboard/dashboard.js"' in page
    policy = resp.headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy
    assert "script-src 'self'" in policy
    assert "connect-src 'self'" in policy
    assert "frame-ancestors 'none'" in policy
    assert resp.headers["Referrer-Policy"] == "no-referrer"


@pytest.mark.parametrize("name", sorted(ASSETS))
async def test_every_file_of_the_page_is_served_and_loads_nothing_from_elsewhere(
    client: TestClient[Any, Any], name: str
) -> None:
    resp = await client.get(f"/dashboard/{name}")
    assert resp.status == 200
    assert resp.content_type == ASSETS[name]
    text = await resp.text()
    # No CDN, no font host: the one absolute URL allowed is the SVG namespace (a name, not a
    # fetch).
    urls = set(re.findall(r"https?://[^\s\"'`)]+", text)) - {"http://www.w3.org/2000/svg"}
    assert urls == set()
    assert "innerHTML" not in text  # server data is rendered as text, never as markup


async def test_an_unknown_dashboard_file_is_a_404_problem(client: TestClient[Any, Any]) -> None:
    resp = await client.get("/dashboard/..%2Fapp.py")
    assert resp.status == 404
    assert (await resp.json(content_type=None))["code"] == "not_found"


async def test_a_browser_passes_its_token_as_a_subprotocol_and_the_server_never_echoes_it(
    client: TestClient[Any, Any],
) -> None:
    token = token_for("ws1")
    await post_ops(client, [insert("a")])
    ws = await client.ws_connect(
        SOCKET, protocols=(SOCKET_SUBPROTOCOL, BEARER_SUBPROTOCOL_PREFIX + token)
    )
    try:
        assert ws.protocol == SOCKET_SUBPROTOCOL
        await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
        frame = await ws.receive_json(timeout=30)
        assert (frame["type"], frame["clock"]) == ("op", 1)
    finally:
        await ws.close()


@pytest.mark.parametrize(
    ("grant", "code"), [("forged", 4001), ("ws2", 4003)], ids=["bad-token", "other-workspace"]
)
async def test_a_subprotocol_token_is_checked_like_a_header(
    client: TestClient[Any, Any], grant: str, code: int
) -> None:
    token = "cvt1.forged.forged" if grant == "forged" else token_for(grant)
    ws = await client.ws_connect(
        SOCKET, protocols=(SOCKET_SUBPROTOCOL, BEARER_SUBPROTOCOL_PREFIX + token)
    )
    msg = await ws.receive(timeout=30)
    assert msg.type == WSMsgType.CLOSE
    assert ws.close_code == code
