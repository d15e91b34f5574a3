"""The access line's level (docs/observability.md): an idle worker's poll that found nothing
(`GET /v1/queue/pending` or `POST /v1/queue/claim` answered 204) is DEBUG, so idle workers do not
fill the server's terminal; the same routes answered with work, or refused, stay INFO, as does
every other request."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.server.conftest import auth

WS = "ws1"
CLASSES = {"worker_classes": ["evaluate"]}


def _levels(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, int, str]]:
    return [
        (r.__dict__["method"], r.__dict__["route"], r.__dict__["status"], r.levelname)
        for r in caplog.records
        if r.name == "cv_server.access"
    ]


async def test_an_idle_poll_that_found_nothing_is_debug_and_one_with_work_is_info(
    client: TestClient[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="cv_server.access")
    headers = auth(WS)
    pending = "/v1/queue/pending?worker_classes=evaluate&timeout=0"
    assert (await client.get(pending, headers=headers)).status == 204
    assert (await client.post("/v1/queue/claim", json=CLASSES, headers=headers)).status == 204
    batch = {**CLASSES, "limit": 5}
    assert (await client.post("/v1/queue/claim", json=batch, headers=headers)).status == 204
    enqueued = await client.post(
        f"/v1/workspaces/{WS}/requests", json={"stage": "evaluate"}, headers=headers
    )
    assert enqueued.status == 202
    assert (await client.get(pending, headers=headers)).status == 200
    assert (await client.post("/v1/queue/claim", json=CLASSES, headers=headers)).status == 200
    refused = "/v1/queue/pending?timeout=0"  # names no worker class
    assert (await client.get(refused, headers=headers)).status == 422
    assert (await client.post("/v1/queue/claim", json=CLASSES)).status == 401

    assert _levels(caplog) == [
        ("GET", "/v1/queue/pending", 204, "DEBUG"),
        ("POST", "/v1/queue/claim", 204, "DEBUG"),
        ("POST", "/v1/queue/claim", 204, "DEBUG"),
        ("POST", "/v1/workspaces/{ws}/requests", 202, "INFO"),
        ("GET", "/v1/queue/pending", 200, "INFO"),
        ("POST", "/v1/queue/claim", 200, "INFO"),
        ("GET", "/v1/queue/pending", 422, "INFO"),
        ("POST", "/v1/queue/claim", 401, "INFO"),
    ]


async def test_at_the_default_level_an_idle_poll_writes_no_line(
    client: TestClient[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="cv_server.access")
    headers = auth(WS)
    for _ in range(3):
        await client.get("/v1/queue/pending?worker_classes=evaluate&timeout=0", headers=headers)
        await client.post("/v1/queue/claim", json=CLASSES, headers=headers)
    await client.get("/healthz")
    assert _levels(caplog) == [("GET", "/healthz", 200, "INFO")]
