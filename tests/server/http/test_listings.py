"""The operators' listings through real HTTP, on both backends: a workspace's sub-docs with their
clocks (`GET /v1/workspaces/{ws}/docs`) and its held compute locks (`GET .../locks`)."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.server.conftest import auth
from tests.server.helpers import insert, post_ops

WS = "ws1"
DOCS = f"/v1/workspaces/{WS}/docs"
LOCKS = f"/v1/workspaces/{WS}/locks"


async def get(client: TestClient[Any, Any], path: str, status: int = 200, **params: Any) -> Any:
    resp = await client.get(path, params=params, headers=auth(WS))
    assert resp.status == status, await resp.text()
    if status >= 400:
        assert resp.content_type == "application/problem+json"
    return await resp.json(content_type=None)


async def acquire(client: TestClient[Any, Any], job: str, task: str, holder: str) -> Any:
    resp = await client.post(
        f"{LOCKS}/acquire", json={"job_id": job, "task": task, "holder": holder}, headers=auth(WS)
    )
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_sub_docs_are_listed_by_name_with_their_head_clocks(
    server: TestClient[Any, Any],
) -> None:
    await post_ops(server, [insert("a"), insert("b")], sub_doc="tree")
    await post_ops(server, [insert("a")], sub_doc="alpha")
    await post_ops(server, [insert("n", parent="missing")], sub_doc="only-rejected")
    await post_ops(server, [insert("a")], sub_doc="other", workspace="ws2")
    body = await get(server, DOCS)
    assert [(d["sub_doc"], d["clock"]) for d in body["docs"]] == [("alpha", 1), ("tree", 2)]
    assert all(isinstance(d["committed_at"], float) for d in body["docs"])
    assert body["next_after"] is None


async def test_a_full_page_of_sub_docs_names_the_next_one(server: TestClient[Any, Any]) -> None:
    for name in ("a", "b", "c"):
        await post_ops(server, [insert("a")], sub_doc=name)
    first = await get(server, DOCS, limit=2)
    assert [d["sub_doc"] for d in first["docs"]] == ["a", "b"]
    second = await get(server, DOCS, limit=2, after=first["next_after"])
    assert [d["sub_doc"] for d in second["docs"]] == ["c"]
    assert second["next_after"] is None


async def test_held_locks_are_listed_with_holder_and_time_left_but_never_their_token(
    server: TestClient[Any, Any],
) -> None:
    won = await acquire(server, "J1", "eval:salary", "worker-7")
    await acquire(server, "J1", "eval:title", "worker-8")
    body = await get(server, LOCKS)
    assert [(lock["job_id"], lock["task"], lock["holder"]) for lock in body["locks"]] == [
        ("J1", "eval:salary", "worker-7"),
        ("J1", "eval:title", "worker-8"),
    ]
    first = body["locks"][0]
    assert first["expires_at"] == won["expires_at"]
    assert 0 < first["expires_in"] <= body["ttl"] == won["ttl"]
    assert "token" not in first
    assert won["token"] not in str(body)


async def test_a_released_lock_is_no_longer_listed(server: TestClient[Any, Any]) -> None:
    won = await acquire(server, "J1", "t", "w")
    body = {"job_id": "J1", "task": "t", "token": won["token"]}
    resp = await server.post(f"{LOCKS}/release", json=body, headers=auth(WS))
    assert (await resp.json())["released"] is True
    assert (await get(server, LOCKS))["locks"] == []


async def test_lock_pages_follow_the_cursor(server: TestClient[Any, Any]) -> None:
    for task in ("a", "b", "c"):
        await acquire(server, "J", task, "w")
    first = await get(server, LOCKS, limit=2)
    second = await get(server, LOCKS, limit=2, after=first["next_after"])
    assert [lock["task"] for lock in first["locks"] + second["locks"]] == ["a", "b", "c"]
    assert second["next_after"] is None


@pytest.mark.parametrize("path", [DOCS, LOCKS])
@pytest.mark.parametrize("limit", ["0", "1001", "-1", "ten", ""])
async def test_a_bad_limit_is_a_422_problem(
    server: TestClient[Any, Any], path: str, limit: str
) -> None:
    body = await get(server, path, status=422, limit=limit)
    assert body["code"] == "invalid_field"


@pytest.mark.parametrize(
    ("path", "after"),
    [(DOCS, "Not A Sub-Doc"), (DOCS, "x" * 65), (LOCKS, "not-base64!"), (LOCKS, "WzFd")],
)
async def test_a_forged_cursor_is_a_422_problem(
    server: TestClient[Any, Any], path: str, after: str
) -> None:
    body = await get(server, path, status=422, after=after)
    assert body["code"] == "invalid_field"


@pytest.mark.parametrize("path", ["docs", "locks"])
async def test_listings_need_a_token_granting_the_workspace(
    server: TestClient[Any, Any], path: str
) -> None:
    missing = await server.get(f"/v1/workspaces/{WS}/{path}")
    assert missing.status == 401
    other = await server.get(f"/v1/workspaces/{WS}/{path}", headers=auth("ws2"))
    assert other.status == 403
    assert (await other.json())["code"] == "forbidden_workspace"
    bad = await server.get(f"/v1/workspaces/bad%20id/{path}", headers=auth("*"))
    assert bad.status == 422
