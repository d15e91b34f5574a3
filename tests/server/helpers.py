"""Small helpers shared by the server integration tests."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from cv_mutations import new_op_id
from cv_server.keys import WORK_SIGNALS
from tests.server.conftest import auth

WS = "ws1"
#: How long a lifted long poll waits: far past any test's bound.
LIFTED_CEILING = 3600.0


def insert(node_id: str, parent: str = "root", op_id: str | None = None) -> dict[str, Any]:
    return {"type": "node.insert", "node_id": node_id, "parent_id": parent, "op_id": op_id}


def increment(node_id: str = "n", by: int = 1, op_id: str | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"type": "node.increment", "node_id": node_id, "field": "count", "by": by}
    op["op_id"] = op_id or new_op_id()
    return op


async def post_ops(
    client: TestClient[Any, Any],
    ops: list[dict[str, Any]],
    *,
    sub_doc: str = "tree",
    workspace: str = WS,
    atomic: bool | None = None,
    status: int = 200,
) -> dict[str, Any]:
    body: dict[str, Any] = {"ops": ops}
    if atomic is not None:
        body["atomic"] = atomic
    resp = await client.post(
        f"/v1/workspaces/{workspace}/docs/{sub_doc}/ops", json=body, headers=auth(workspace)
    )
    assert resp.status == status, await resp.text()
    result: dict[str, Any] = await resp.json(content_type=None)
    return result


async def get_doc(
    client: TestClient[Any, Any], sub_doc: str = "tree", workspace: str = WS
) -> dict[str, Any]:
    resp = await client.get(f"/v1/workspaces/{workspace}/docs/{sub_doc}", headers=auth(workspace))
    assert resp.status == 200, await resp.text()
    result: dict[str, Any] = await resp.json()
    return result


async def get_ops(
    client: TestClient[Any, Any], since: int = 0, sub_doc: str = "tree", workspace: str = WS
) -> dict[str, Any]:
    resp = await client.get(
        f"/v1/workspaces/{workspace}/docs/{sub_doc}/ops",
        params={"since": since},
        headers=auth(workspace),
    )
    assert resp.status == 200, await resp.text()
    result: dict[str, Any] = await resp.json()
    return result


async def counter(client: TestClient[Any, Any], node_id: str = "n", sub_doc: str = "tree") -> Any:
    doc = await get_doc(client, sub_doc)
    return doc["state"]["nodes"][node_id]["fields"].get("count")


async def enqueue(
    client: TestClient[Any, Any],
    body: dict[str, Any],
    *,
    workspace: str = "ws1",
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    """`POST .../requests`: the status and the answer."""
    resp = await client.post(
        f"/v1/workspaces/{workspace}/requests",
        json=body,
        headers={**auth(workspace), **(headers or {})},
    )
    return resp.status, await resp.json(content_type=None)


async def claim(client: TestClient[Any, Any], workspace: str = "ws1") -> Any:
    """Claim one `evaluate` request: its row, or None when there is none."""
    resp = await client.post(
        "/v1/queue/claim", json={"worker_classes": ["evaluate"]}, headers=auth(workspace)
    )
    if resp.status == 204:
        return None
    assert resp.status == 200, await resp.text()
    return (await resp.json())["request"]


def lift_long_poll_ceiling(app: web.Application, monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the idle workers' long polls on the started `app` (`/v1/queue/pending`, 2 s at most)
    wait `LIFTED_CEILING` instead. Such a poll is answered by a push or by the shutdown, never
    first by its ceiling on a machine too busy to push within 2 s: its 200 is the push, its 204
    the shutdown."""
    signals = app[WORK_SIGNALS]
    wait = signals.wait

    async def lifted(
        classes: frozenset[str],
        workspaces: frozenset[str] | None,
        patience: float,
        *,
        pending_now: Callable[[], Awaitable[bool]] | None = None,
    ) -> bool:
        return await wait(classes, workspaces, LIFTED_CEILING, pending_now=pending_now)

    monkeypatch.setattr(signals, "wait", lifted)
