"""Report and claim (docs/queue.md): `claim_next` on the complete routes (single and batch) and on
`fail`, through a real server on loopback, on both backends. The claim commits with the report,
answers as the claim route renders rows, is scoped by the token like `POST /v1/queue/claim`, is
counted like it; a bad `claim_next` is refused whole (nothing reported, nothing claimed); a
refused report still claims; without `claim_next` the answers are those of before."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from cv_server.keys import STORES
from tests.observe.scrape import scrape
from tests.server.conftest import auth

WS = "ws1"
REQUESTS = f"/v1/workspaces/{WS}/requests"
NEXT = {"worker_classes": ["s"], "worker_id": "w-next"}


async def _post(
    server: TestClient[Any, Any], path: str, body: Any, workspaces: tuple[str, ...] = (WS,)
) -> tuple[int, Any]:
    resp = await server.post(path, json=body, headers=auth(*workspaces))
    return resp.status, await resp.json(content_type=None)


async def _enqueue(server: TestClient[Any, Any], n: int, ws: str = WS) -> list[str]:
    ids = []
    for _ in range(n):
        status, answer = await _post(
            server, f"/v1/workspaces/{ws}/requests", {"stage": "s"}, workspaces=(ws,)
        )
        assert status == 202, answer
        ids.append(answer["request_id"])
    return ids


async def _claim(server: TestClient[Any, Any]) -> Any:
    status, answer = await _post(server, "/v1/queue/claim", {"worker_classes": ["s"]})
    assert status == 200, answer
    return answer["request"]


async def _row(server: TestClient[Any, Any], request_id: str, ws: str = WS) -> Any:
    resp = await server.get(f"/v1/workspaces/{ws}/requests/{request_id}", headers=auth(ws))
    assert resp.status == 200
    return await resp.json()


async def _claim_token_of(server: TestClient[Any, Any], request_id: str) -> str:
    """The row's claim token as the store holds it (no route shows it to a reader)."""
    assert server.app is not None
    row = await server.app[STORES].queue.get(WS, request_id)
    assert row is not None
    assert row.claim_token is not None
    return str(row.claim_token)


def _report_path(row: Any, verb: str) -> str:
    return f"{REQUESTS}/{row['request_id']}/{verb}"


async def test_complete_with_claim_next_finishes_one_and_claims_the_next_in_one_call(
    server: TestClient[Any, Any],
) -> None:
    first_id, second_id = await _enqueue(server, 2)
    held = await _claim(server)
    assert held["request_id"] == first_id
    before = await scrape(server)
    status, answer = await _post(
        server,
        _report_path(held, "complete"),
        {"claim_token": held["claim_token"], "result": 1, "claim_next": NEXT},
    )
    assert status == 200, answer
    assert answer["status"] == "done"
    [claimed] = answer["claimed"]
    assert claimed["request_id"] == second_id
    assert claimed["status"] == "in_progress"
    assert claimed["claimed_by"] == "w-next"
    assert claimed["lease_expires_at"] > claimed["claimed_at"]
    assert (await _row(server, first_id))["status"] == "done"
    after = await scrape(server)
    # Counted as the claim route's claims are (the store's observer), and the one done too.
    assert after["cv_queue_claimed_total"] - before["cv_queue_claimed_total"] == 1
    assert after["cv_queue_done_total"] - before["cv_queue_done_total"] == 1
    # The claimed row's token fences it as a claim route's would.
    status, answer = await _post(
        server, _report_path(claimed, "complete"), {"claim_token": claimed["claim_token"]}
    )
    assert (status, answer) == (200, {"status": "done"})


async def test_batch_complete_with_claim_next_claims_up_to_its_limit(
    server: TestClient[Any, Any],
) -> None:
    ids = await _enqueue(server, 4)
    held = [await _claim(server), await _claim(server)]
    body = {
        "completions": [
            {"request_id": row["request_id"], "claim_token": row["claim_token"], "result": i}
            for i, row in enumerate(held)
        ],
        "claim_next": {**NEXT, "limit": 5},
    }
    before = await scrape(server)
    status, answer = await _post(server, "/v1/queue/complete", body)
    assert status == 200, answer
    assert answer["results"] == [{"request_id": i, "status": "done"} for i in ids[:2]]
    assert sorted(row["request_id"] for row in answer["claimed"]) == sorted(ids[2:])
    assert all(row["claim_token"] for row in answer["claimed"])
    after = await scrape(server)
    assert after["cv_queue_claimed_total"] - before["cv_queue_claimed_total"] == 2


async def test_fail_with_claim_next_backs_off_and_claims_another(
    server: TestClient[Any, Any],
) -> None:
    first_id, second_id = await _enqueue(server, 2)
    held = await _claim(server)
    status, answer = await _post(
        server,
        _report_path(held, "fail"),
        {"claim_token": held["claim_token"], "error": {"code": "x"}, "claim_next": NEXT},
    )
    assert status == 200, answer
    assert answer["status"] == "pending"
    assert answer["available_at"] > 0
    # The failed one is backing off: the claim takes the other.
    assert [row["request_id"] for row in answer["claimed"]] == [second_id]
    assert (await _row(server, first_id))["error"] == {"code": "x"}


async def test_an_empty_queue_claims_nothing_and_answers_an_empty_list(
    server: TestClient[Any, Any],
) -> None:
    await _enqueue(server, 1)
    held = await _claim(server)
    status, answer = await _post(
        server,
        _report_path(held, "complete"),
        {"claim_token": held["claim_token"], "claim_next": NEXT},
    )
    assert (status, answer) == (200, {"status": "done", "claimed": []})


async def test_without_claim_next_each_answer_is_as_before(server: TestClient[Any, Any]) -> None:
    await _enqueue(server, 3)
    one, two, three = await _claim(server), await _claim(server), await _claim(server)
    resp = await server.post(
        _report_path(one, "complete"), json={"claim_token": one["claim_token"]}, headers=auth(WS)
    )
    # The same JSON document (no `claimed` member), whatever the writer's spacing.
    assert (resp.status, await resp.json()) == (200, {"status": "done"})
    status, answer = await _post(
        server,
        "/v1/queue/complete",
        {"completions": [{"request_id": two["request_id"], "claim_token": two["claim_token"]}]},
    )
    assert (status, answer) == (
        200,
        {"results": [{"request_id": two["request_id"], "status": "done"}]},
    )
    status, answer = await _post(
        server, _report_path(three, "fail"), {"claim_token": three["claim_token"]}
    )
    assert (status, set(answer)) == (200, {"status", "available_at"})


BAD_NEXT = [
    pytest.param({"worker_classes": []}, id="no-class"),
    pytest.param({"worker_classes": ["s"], "limit": 0}, id="limit-0"),
    pytest.param({"worker_classes": ["s"], "limit": 1001}, id="limit-past-1000"),
    pytest.param({"worker_classes": ["s"], "worker_id": "w" * 257}, id="long-worker-id"),
    pytest.param({"worker_classes": ["x" * 65]}, id="long-class"),
    pytest.param({"worker_classes": ["s"], "limit": "2"}, id="limit-as-text"),
    pytest.param(["s"], id="not-an-object"),
]


@pytest.mark.parametrize("bad", BAD_NEXT)
@pytest.mark.parametrize("verb", ["complete", "fail", "batch"])
async def test_a_bad_claim_next_is_refused_and_neither_reports_nor_claims(
    server: TestClient[Any, Any], verb: str, bad: Any
) -> None:
    held_id, waiting_id = await _enqueue(server, 2)
    held = await _claim(server)
    refusal = (422, "invalid_field")
    if isinstance(bad, dict):  # the claim route refuses the same ask the same way
        status, problem = await _post(server, "/v1/queue/claim", bad)
        assert (status, problem["code"]) == refusal
    token = held["claim_token"]
    if verb == "batch":
        path = "/v1/queue/complete"
        body: dict[str, Any] = {"completions": [{"request_id": held_id, "claim_token": token}]}
    else:
        path, body = _report_path(held, verb), {"claim_token": token}
    status, problem = await _post(server, path, {**body, "claim_next": bad})
    assert (status, problem["code"]) == refusal
    assert problem["detail"].startswith("claim_next")
    row = await _row(server, held_id)
    assert (row["status"], row["dequeue_count"]) == ("in_progress", 1)
    assert row["error"] is None
    waiting = await _row(server, waiting_id)
    assert (waiting["status"], waiting["dequeue_count"]) == ("pending", 0)


@pytest.mark.parametrize("verb", ["complete", "fail", "batch"])
async def test_a_report_refused_for_a_lost_lease_still_claims(
    server: TestClient[Any, Any], verb: str
) -> None:
    held_id, waiting_id = await _enqueue(server, 2)
    held = await _claim(server)
    stale = {"claim_token": "not-the-token", "claim_next": NEXT}
    if verb == "batch":
        status, answer = await _post(
            server,
            "/v1/queue/complete",
            {"completions": [{"request_id": held_id, "claim_token": "x"}], "claim_next": NEXT},
        )
        assert answer["results"][0]["error"]["code"] == "lease_lost"
    else:
        status, answer = await _post(server, _report_path(held, verb), stale)
        assert answer["error"]["code"] == "lease_lost"
        assert "status" not in answer
    assert status == 200, answer
    assert [row["request_id"] for row in answer["claimed"]] == [waiting_id]
    row = await _row(server, held_id)
    assert (row["status"], row["error"]) == ("in_progress", None)  # nothing reported
    assert held["claim_token"] == (await _claim_token_of(server, held_id))


async def test_claim_next_claims_only_in_the_workspaces_the_token_grants(
    server: TestClient[Any, Any],
) -> None:
    await _enqueue(server, 1, ws="other")
    [own] = await _enqueue(server, 1)
    held = await _claim(server)
    assert held["request_id"] == own
    status, answer = await _post(
        server,
        _report_path(held, "complete"),
        {"claim_token": held["claim_token"], "claim_next": NEXT},
    )
    assert (status, answer["claimed"]) == (200, [])  # `other` is not the token's
    status, answer = await _post(
        server, "/v1/queue/claim", {"worker_classes": ["s"]}, workspaces=("other",)
    )
    assert status == 200
