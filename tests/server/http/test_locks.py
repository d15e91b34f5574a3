"""The compute lock through real HTTP: one winner among racing workers, release by holder only."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp.test_utils import TestClient

from tests.server.conftest import auth

LOCKS = "/v1/workspaces/ws1/locks"


async def _acquire(client: TestClient[Any, Any], holder: str, ws: str = "ws1") -> Any:
    resp = await client.post(
        f"/v1/workspaces/{ws}/locks/acquire",
        json={"job_id": "J1", "task": "eval:salary", "holder": holder},
        headers=auth(ws),
    )
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_of_many_racing_acquirers_exactly_one_gets_the_lock(
    client: TestClient[Any, Any],
) -> None:
    answers = await asyncio.gather(*(_acquire(client, f"w{i}") for i in range(30)))
    winners = [a for a in answers if a["acquired"]]
    assert len(winners) == 1
    assert all(a["locked"] for a in answers if not a["acquired"])


async def test_only_the_holder_releases_and_then_the_key_is_free(
    client: TestClient[Any, Any],
) -> None:
    won = await _acquire(client, "w1")
    body = {"job_id": "J1", "task": "eval:salary"}
    wrong = await client.post(
        f"{LOCKS}/release", json={**body, "token": "forged"}, headers=auth("ws1")
    )
    assert (await wrong.json())["released"] is False
    assert (await _acquire(client, "w2"))["acquired"] is False
    right = await client.post(
        f"{LOCKS}/release", json={**body, "token": won["token"]}, headers=auth("ws1")
    )
    assert (await right.json())["released"] is True
    assert (await _acquire(client, "w2"))["acquired"] is True


async def test_locks_are_scoped_to_the_workspace(client: TestClient[Any, Any]) -> None:
    assert (await _acquire(client, "w1", "ws1"))["acquired"] is True
    assert (await _acquire(client, "w1", "ws2"))["acquired"] is True
    resp = await client.post(
        f"{LOCKS}/acquire", json={"job_id": "J1", "task": "t"}, headers=auth("ws2")
    )
    assert resp.status == 403
