"""Idempotency keys through a real server on loopback, on both backends (docs/queue.md): one key
in two workspaces names two independent requests, a reused key is refused with the same code
whatever the first outcome, and a key whose first request died with its server is free after a
restart."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.keys import STORES
from cv_server.queue import request_fingerprint
from tests.server.conftest import ClientFactory, auth
from tests.server.helpers import enqueue

# -- idempotency keys ------------------------------------------------------------------------------


async def test_one_idempotency_key_in_two_workspaces_names_two_independent_requests(
    server: TestClient[Any, Any],
) -> None:
    body = {"stage": "scrape", "input": {"url": "x"}}
    key = {"Idempotency-Key": "shared-key"}
    status1, first = await enqueue(server, body, workspace="ws1", headers=key)
    status2, second = await enqueue(server, body, workspace="ws2", headers=key)
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
    _, refused = await enqueue(
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
    status, refused = await enqueue(server, {"stage": ""}, headers=key)
    assert (status, refused["code"]) == (422, "invalid_field")
    status, accepted = await enqueue(server, {"stage": "evaluate"}, headers=key)
    assert status == 202
    assert not accepted["coalesced"]
    for other in ({"stage": "evaluate", "input": 1}, {"stage": "other"}, {"stage": ""}):
        status, answer = await enqueue(server, other, headers=key)
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
