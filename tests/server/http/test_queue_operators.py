"""The queue's operator verbs, result blobs, idempotency keys, the result stream and `fail` through
a real server on loopback, on both backends (SQLite and PostgreSQL): bad input on these routes is
refused with a stable 4xx and leaves nothing behind."""

from __future__ import annotations

from typing import Any

from aiohttp.test_utils import TestClient

from tests.server.conftest import auth

WS = "ws1"
REQUESTS = f"/v1/workspaces/{WS}/requests"


async def _post(
    server: TestClient[Any, Any], path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    resp = await server.post(path, json=body, headers={**auth(WS), **(headers or {})})
    return resp.status, await resp.json(content_type=None)


async def _claim(server: TestClient[Any, Any]) -> Any:
    status, answer = await _post(server, "/v1/queue/claim", {"worker_classes": ["s"]})
    assert status == 200, answer
    return answer["request"]


async def _listed(server: TestClient[Any, Any]) -> list[Any]:
    resp = await server.get("/v1/queue/requests", params={"workspace": WS}, headers=auth(WS))
    assert resp.status == 200, await resp.text()
    return list((await resp.json())["requests"])


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


# -- payloads a row could store but never give back ------------------------------------------------


async def test_a_payload_nested_too_deeply_to_read_back_is_refused_on_every_route_that_stores_one(
    server: TestClient[Any, Any],
) -> None:
    """A row holding a payload ~500 levels deep was written, then every read of it (its GET, its
    stream, the workspace's listing, a claim) answered 500 for good. Refused up front now."""
    deep = _nested(600)
    status, problem = await _post(server, REQUESTS, {"stage": "s", "input": deep})
    assert (status, problem.get("code")) == (422, "invalid_field")
    status, problem = await _post(
        server, REQUESTS, {"stage": "s", "input": deep}, {"Idempotency-Key": "k-deep"}
    )
    assert (status, problem.get("code")) == (422, "invalid_field")
    assert await _listed(server) == []  # nothing was enqueued

    status, answer = await _post(server, REQUESTS, {"stage": "s"}, {"Idempotency-Key": "k-deep"})
    assert status == 202, answer  # the refused attempt did not take the key
    held = await _claim(server)
    base = f"{REQUESTS}/{answer['request_id']}"
    token = held["claim_token"]
    batch_item = {"request_id": answer["request_id"], "claim_token": token}
    for path, body in [
        (f"{base}/fail", {"claim_token": token, "error": deep}),
        (f"{base}/complete", {"claim_token": token, "result": deep}),
        (f"{base}/complete", {"claim_token": token, "result": 1, "error": deep}),
        # (Telemetry too deep to store is dropped instead, never refused: it is fire-and-forget,
        # tests/observe/test_metrics_workload.py.)
        (
            "/v1/queue/complete",
            {"completions": [{**batch_item, "error": deep}]},
        ),
    ]:
        status, problem = await _post(server, path, body)
        assert (status, problem.get("code")) == (422, "invalid_field"), (path, body.keys(), problem)
    # Nothing was applied: the holder still holds the request, which reads back.
    status, _ = await _post(server, f"{base}/heartbeat", {"claim_token": token})
    assert status == 200
    [row] = await _listed(server)
    assert (row["status"], row["error"]) == ("in_progress", None)
    # A payload as deep as orjson writes is stored and read back whole.
    shallow = _nested(200)
    status, failed = await _post(server, f"{base}/fail", {"claim_token": token, "error": shallow})
    assert (status, failed["status"]) == (200, "pending")
    resp = await server.get(base, headers=auth(WS))
    assert resp.status == 200
    assert (await resp.json())["error"] == shallow
    assert [r["error"] for r in await _listed(server)] == [shallow]


async def test_a_max_dequeues_beyond_the_stores_range_is_refused_not_a_server_error(
    server: TestClient[Any, Any],
) -> None:
    """2**31 reached PostgreSQL's integer column (2**63 SQLite's) and answered 500."""
    for too_many in (2**31, 2**63):
        for headers in ({}, {"Idempotency-Key": "k-max"}):
            status, problem = await _post(
                server, REQUESTS, {"stage": "s", "max_dequeues": too_many}, headers
            )
            assert (status, problem.get("code")) == (422, "invalid_field"), problem
    assert await _listed(server) == []
    status, answer = await _post(
        server, REQUESTS, {"stage": "s", "max_dequeues": 2**31 - 1}, {"Idempotency-Key": "k-max"}
    )
    assert status == 202, answer
    [row] = await _listed(server)
    assert row["max_dequeues"] == 2**31 - 1


# -- the operators' listing ------------------------------------------------------------------------


async def _poisoned(server: TestClient[Any, Any], job_id: str, workspace: str = WS) -> str:
    """A new request of `workspace` that failed its only attempt: poison."""
    headers = auth(workspace)
    resp = await server.post(
        f"/v1/workspaces/{workspace}/requests",
        json={"stage": "s", "job_id": job_id, "max_dequeues": 1, "worker_class": job_id},
        headers=headers,
    )
    request_id: str = (await resp.json())["request_id"]
    # A class of its own: replayed and re-run rows stay pending, unclaimed, for the listing.
    resp = await server.post("/v1/queue/claim", json={"worker_classes": [job_id]}, headers=headers)
    held = (await resp.json())["request"]
    assert held["request_id"] == request_id
    resp = await server.post(
        f"/v1/workspaces/{workspace}/requests/{request_id}/fail",
        json={"claim_token": held["claim_token"]},
        headers=headers,
    )
    assert (await resp.json())["status"] == "poison"
    return request_id


async def _page(server: TestClient[Any, Any], after: str | None) -> tuple[list[Any], Any]:
    params = {"workspace": WS, "status": "poison", "limit": "2"}
    if after is not None:
        params["after"] = after
    resp = await server.get("/v1/queue/requests", params=params, headers=auth(WS))
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    return answer["requests"], answer.get("next_after")


async def test_an_operator_pages_through_every_poison_request_while_the_queue_changes(
    server: TestClient[Any, Any],
) -> None:
    """The listing had no next page: past its first `limit` rows (at most 1000) a poison request
    could not be listed, hence not found to be replayed by hand. Pages now follow each other
    (`next_after`), and a row that stays poison throughout is listed exactly once, however the
    rows around it change between pages (replayed, re-run, newly poisoned) - never another
    workspace's."""
    ours = []
    for i in range(6):
        ours.append(await _poisoned(server, f"ours-{i}"))
        await _poisoned(server, f"theirs-{i}", workspace="ws2")
        status, _ = await _post(server, REQUESTS, {"stage": "other", "job_id": f"live-{i}"})
        assert status == 202
    first, cursor = await _page(server, None)
    assert [r["request_id"] for r in first] == ours[:2]
    assert cursor is not None, "a full page names the next one"
    # Between pages: the cursor's own row is re-run (its created_at moves to now), a row already
    # listed and one not yet listed are replayed, and a new request turns poison.
    status, _ = await _post(server, REQUESTS, {"stage": "s", "job_id": "ours-1", "rerun": True})
    assert status == 202
    for request_id in (ours[0], ours[3]):
        status, _ = await _post(server, f"{REQUESTS}/{request_id}/replay", None)
        assert status == 200
    newcomer = await _poisoned(server, "ours-6")
    listed = [r["request_id"] for r in first]
    while cursor is not None:
        page, cursor = await _page(server, cursor)
        assert all((r["workspace_id"], r["status"]) == (WS, "poison") for r in page), page
        listed += [r["request_id"] for r in page]
    assert listed == [*ours[:3], *ours[4:], newcomer]


async def test_a_listing_cursor_that_is_not_one_is_refused(server: TestClient[Any, Any]) -> None:
    await _poisoned(server, "j")
    for after in ("", "x", "1.5", "1.5,", "nan,r_1", "inf,r_1", "1.5,r\x00", "1.5," + "r" * 257):
        resp = await server.get(
            "/v1/queue/requests", params={"workspace": WS, "after": after}, headers=auth(WS)
        )
        assert resp.status == 422, (after, await resp.text())
        assert (await resp.json())["code"] == "invalid_field"


# -- discarding a poison request -------------------------------------------------------------------


async def test_an_operator_discards_a_poison_request_which_is_then_gone(
    server: TestClient[Any, Any],
) -> None:
    request_id = await _poisoned(server, "j")
    status, before = await _post(server, f"{REQUESTS}/{request_id}/discard", None)
    assert (status, before["request_id"], before["status"]) == (200, request_id, "poison")
    resp = await server.get(f"{REQUESTS}/{request_id}", headers=auth(WS))
    assert resp.status == 404
    assert await _listed(server) == []
    status, problem = await _post(server, f"{REQUESTS}/{request_id}/discard", None)
    assert (status, problem["code"]) == (404, "not_found")
    metrics = await (await server.get("/metrics")).text()
    assert "cv_queue_discarded_total 1.0" in metrics
    # The same enqueue makes a new request, which runs.
    status, answer = await _post(
        server, REQUESTS, {"stage": "s", "job_id": "j", "worker_class": "j"}
    )
    assert (status, answer["request_id"], answer["status"]) == (202, request_id, "pending")


async def test_only_a_poison_request_may_be_discarded(server: TestClient[Any, Any]) -> None:
    status, answer = await _post(server, REQUESTS, {"stage": "s", "job_id": "live"})
    assert status == 202
    live = answer["request_id"]
    status, problem = await _post(server, f"{REQUESTS}/{live}/discard", None)
    assert (status, problem["code"]) == (409, "not_discardable")
    assert problem["type"] == "about:blank"
    held = await _claim(server)
    status, _ = await _post(
        server, f"{REQUESTS}/{live}/complete", {"claim_token": held["claim_token"], "result": 1}
    )
    assert status == 200
    status, problem = await _post(server, f"{REQUESTS}/{live}/discard", None)
    assert (status, problem["code"]) == (409, "not_discardable")
    assert [r["status"] for r in await _listed(server)] == ["done"]  # nothing deleted


async def test_a_discard_is_fenced_by_the_workspace_like_a_replay(
    server: TestClient[Any, Any],
) -> None:
    request_id = await _poisoned(server, "j")
    path = f"{REQUESTS}/{request_id}/discard"
    resp = await server.post(path, headers=auth("ws2"))  # a token for another workspace
    assert resp.status == 403
    assert (await resp.json())["code"] == "forbidden_workspace"
    resp = await server.post(path)  # no token at all
    assert resp.status == 401
    resp = await server.post(
        f"/v1/workspaces/ws2/requests/{request_id}/discard", headers=auth("ws2")
    )
    assert resp.status == 404  # ws1's request is not found under ws2
    assert [r["status"] for r in await _listed(server)] == ["poison"]
