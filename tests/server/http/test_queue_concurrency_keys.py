"""Concurrency keys through real HTTP (docs/queue.md, "Concurrency keys"): the enqueue routes
take a key and a limit, the claim route keeps the limit, and bad values are refused whole."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.server.conftest import auth

REQUESTS = "/v1/workspaces/ws1/requests"


async def _claim(client: TestClient[Any, Any]) -> Any:
    resp = await client.post(
        "/v1/queue/claim",
        json={"worker_classes": ["evaluate"], "worker_id": "w1"},
        headers=auth("ws1"),
    )
    if resp.status == 204:
        return None
    assert resp.status == 200, await resp.text()
    return (await resp.json())["request"]


async def test_a_keyed_enqueue_is_claimed_no_more_than_its_limit_at_once(
    client: TestClient[Any, Any],
) -> None:
    keyed = {"stage": "evaluate", "concurrency_key": "customer-7", "max_running_per_key": 1}
    ids = []
    for job in ("a", "b"):
        resp = await client.post(REQUESTS, json={**keyed, "job_id": job}, headers=auth("ws1"))
        assert resp.status == 202, await resp.text()
        ids.append((await resp.json())["request_id"])
    resp = await client.post(
        f"{REQUESTS}/batch",
        json={"requests": [{**keyed, "job_id": "c"}, {"stage": "evaluate", "job_id": "plain"}]},
        headers=auth("ws1"),
    )
    assert resp.status == 202, await resp.text()
    ids.append((await resp.json())["results"][0]["request_id"])
    first = await _claim(client)
    assert (first["concurrency_key"], first["max_running_per_key"]) == ("customer-7", 1)
    second = await _claim(client)
    assert second["job_id"] == "plain"  # the key's other rows wait; other work does not
    assert await _claim(client) is None
    rows = [
        await (await client.get(f"{REQUESTS}/{request_id}", headers=auth("ws1"))).json()
        for request_id in ids
    ]
    assert [(r["status"], r["concurrency_key"], r["max_running_per_key"]) for r in rows] == [
        ("in_progress", "customer-7", 1),
        ("pending", "customer-7", 1),
        ("pending", "customer-7", 1),
    ]


@pytest.mark.parametrize(
    "body",
    [
        {"max_running_per_key": 2},  # a limit of no key
        {"concurrency_key": "k", "max_running_per_key": 0},
        {"concurrency_key": "k", "max_running_per_key": 2**31},
        {"concurrency_key": "k", "max_running_per_key": "2"},
        {"concurrency_key": ""},
        {"concurrency_key": "k" * 257},
        {"concurrency_key": 7},
    ],
)
async def test_a_bad_key_or_limit_is_refused_and_nothing_is_enqueued(
    client: TestClient[Any, Any], body: dict[str, Any]
) -> None:
    resp = await client.post(
        REQUESTS, json={"stage": "evaluate", "job_id": "j", **body}, headers=auth("ws1")
    )
    assert resp.status == 422, await resp.text()
    assert (await resp.json())["code"] == "invalid_field"
    batch = await client.post(
        f"{REQUESTS}/batch",
        json={"requests": [{"stage": "evaluate", "job_id": "ok"}, {"stage": "evaluate", **body}]},
        headers=auth("ws1"),
    )
    assert batch.status == 422, await batch.text()
    assert await _claim(client) is None
