"""The batched enqueue route through real HTTP on both backends: `POST
/v1/workspaces/{ws}/requests/batch` answers each item as the single route answers it, refuses a
bad item as a whole, and counts, limits and authorises as the single route does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.http.models import BATCH_ITEMS_MAX
from tests.observe.scrape import scrape
from tests.server.conftest import ClientFactory, auth

REQUESTS = "/v1/workspaces/ws1/requests"
BATCH = f"{REQUESTS}/batch"


async def _batch(
    client: TestClient[Any, Any], body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any, Any]:
    resp = await client.post(BATCH, json=body, headers={**auth("ws1"), **(headers or {})})
    return resp.status, await resp.json(content_type=None), resp.headers


async def _single(client: TestClient[Any, Any], body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post(REQUESTS, json=body, headers=auth("ws1"))
    assert resp.status == 202, await resp.text()
    answer: dict[str, Any] = await resp.json()
    return answer


async def _rows(client: TestClient[Any, Any]) -> list[Any]:
    resp = await client.get("/v1/queue/requests", params={"workspace": "ws1"}, headers=auth("ws1"))
    assert resp.status == 200, await resp.text()
    rows: list[Any] = (await resp.json())["requests"]
    return rows


async def test_each_item_is_answered_in_order_as_the_single_route_answers_it(
    aiohttp_client: ClientFactory, make_server_config: Callable[..., ServerConfig]
) -> None:
    client = await aiohttp_client(create_app(make_server_config()))
    items: list[dict[str, Any]] = [
        {"stage": "evaluate", "job_id": "J2", "input": {"v": 1}},
        {"stage": "evaluate", "job_id": "J1", "branch_path": "main"},
        {"stage": "render"},  # no job: a random id
        {"stage": "evaluate", "job_id": "J2", "input": {"v": 2}},  # a duplicate in the batch
    ]
    status, answer, _ = await _batch(client, {"requests": items})
    assert status == 202, answer
    results = answer["results"]
    assert [r["coalesced"] for r in results] == [False, False, False, True]
    assert [r["input_differs"] for r in results] == [False, False, False, True]
    assert results[3]["request_id"] == results[0]["request_id"]
    assert results[2]["request_id"].startswith("r_")
    # The single route, sent the same bodies afterwards, names the same rows (the same ids).
    for item, result in zip(items, results, strict=True):
        if "job_id" in item:
            single = await _single(client, item)
            assert single == {**result, "coalesced": True, "input_differs": single["input_differs"]}
    assert [row["request_id"] for row in await _rows(client)] == [
        r["request_id"] for r in results[:3]
    ]


async def test_a_bad_item_refuses_the_whole_call_naming_its_index(
    aiohttp_client: ClientFactory, make_server_config: Callable[..., ServerConfig]
) -> None:
    client = await aiohttp_client(create_app(make_server_config()))
    good = {"stage": "evaluate", "job_id": "J1"}
    for bad, index in (
        ([good, {"stage": "evaluate", "max_dequeues": 0}], 1),
        ([good, good, {"stage": "evaluate", "surprise": 1}], 2),  # a member the single body lacks
        ([{"job_id": "J1"}], 0),  # no stage
        ([good, "evaluate"], 1),
        ([good, {"stage": "evaluate", "input": _deep(300)}], 1),
    ):
        status, problem, headers = await _batch(client, {"requests": bad})
        assert status == 422, problem
        assert headers["Content-Type"].startswith("application/problem+json")
        assert (problem["code"], problem["item_index"]) == ("invalid_field", index)
        assert problem["detail"].startswith(f"requests[{index}]: ")
    assert await _rows(client) == []


def _deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


async def test_the_batch_size_is_bounded_as_the_batch_complete_route_bounds_it(
    client: TestClient[Any, Any],
) -> None:
    item = {"stage": "evaluate"}
    bodies: list[dict[str, Any]] = [
        {"requests": []},
        {"requests": [item] * (BATCH_ITEMS_MAX + 1)},
        {"requests": item},
        {"requests": [item], "extra": True},
    ]
    for body in bodies:
        status, problem, _ = await _batch(client, body)
        assert (status, problem["code"]) == (422, "invalid_field"), problem
    assert await _rows(client) == []
    status, answer, _ = await _batch(client, {"requests": [item] * BATCH_ITEMS_MAX})
    assert status == 202
    assert len(answer["results"]) == BATCH_ITEMS_MAX


async def test_the_token_must_grant_the_workspace(client: TestClient[Any, Any]) -> None:
    body = {"requests": [{"stage": "evaluate"}]}
    resp = await client.post(BATCH, json=body, headers=auth("other"))
    assert resp.status == 403
    resp = await client.post(BATCH, json=body)
    assert resp.status == 401
    assert await _rows(client) == []


async def test_a_batch_of_n_counts_as_n_enqueues(
    aiohttp_client: ClientFactory, make_server_config: Callable[..., ServerConfig]
) -> None:
    client = await aiohttp_client(create_app(make_server_config()))
    await _single(client, {"stage": "evaluate", "job_id": "J0"})
    before = await scrape(client)
    items = [{"stage": "evaluate", "job_id": f"J{i}"} for i in range(4)]  # J0 exists
    status, _, _ = await _batch(client, {"requests": [*items, items[1]]})
    assert status == 202
    after = await scrape(client)
    enqueued = after["cv_queue_enqueued_total"] - before["cv_queue_enqueued_total"]
    coalesced = after["cv_queue_coalesced_total"] - before["cv_queue_coalesced_total"]
    assert (enqueued, coalesced) == (3, 2)


async def test_a_retry_under_its_idempotency_key_gets_the_first_answer(
    aiohttp_client: ClientFactory, make_server_config: Callable[..., ServerConfig]
) -> None:
    client = await aiohttp_client(create_app(make_server_config()))
    body = {"requests": [{"stage": "render"}, {"stage": "render"}]}  # random ids: would fork
    key = {"Idempotency-Key": "batch-1"}
    status, first, headers = await _batch(client, body, key)
    assert status == 202
    assert "Idempotency-Replayed" not in headers
    status, again, headers = await _batch(client, body, key)
    assert (status, again, headers["Idempotency-Replayed"]) == (202, first, "true")
    assert len(await _rows(client)) == 2
    status, problem, _ = await _batch(client, {"requests": [{"stage": "other"}]}, key)
    assert (status, problem["code"]) == (422, "idempotency_key_reuse")


async def test_the_batch_route_takes_from_the_enqueue_rate_limit(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    config = make_config(rate_limit_enqueue_per_second=0.1, rate_limit_burst_seconds=1.0)
    client = await aiohttp_client(create_app(config))
    status, _, _ = await _batch(client, {"requests": [{"stage": "evaluate"}] * 3})
    assert status == 202
    status, problem, _ = await _batch(client, {"requests": [{"stage": "evaluate"}]})
    assert (status, problem["code"], problem["route_class"]) == (429, "rate_limited", "enqueue")
    resp = await client.post(REQUESTS, json={"stage": "evaluate"}, headers=auth("ws1"))
    assert resp.status == 429  # one bucket for both enqueue routes
