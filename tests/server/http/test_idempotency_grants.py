"""An `Idempotency-Key` is scoped to the enqueuer's grant as well as its workspace
(docs/queue.md, "Idempotency keys"): the same key and body sent under two grants are two
requests with two answers, never one grant's answer replayed to the other; under one grant the
key replays as before. On both backends."""

from __future__ import annotations

import time
from typing import Any

from aiohttp.test_utils import TestClient

from cv_server.auth import mint_token
from tests.server.conftest import SECRET

WS = "ws1"
REQUESTS = f"/v1/workspaces/{WS}/requests"
BODY = {"stage": "scrape", "input": {"url": "x"}}
BATCH = {"requests": [BODY]}


def _token(*scopes: str, sub_docs: list[str] | None = None) -> str:
    return mint_token(
        SECRET, [WS], now=time.time(), ttl=600, scopes=scopes or None, sub_docs=sub_docs
    )


async def _post(
    server: TestClient[Any, Any], path: str, body: dict[str, Any], token: str, key: str
) -> tuple[int, Any, str | None]:
    headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": key}
    async with server.post(path, json=body, headers=headers) as resp:
        return resp.status, await resp.json(), resp.headers.get("Idempotency-Replayed")


async def test_the_same_key_and_body_under_another_grant_is_a_request_of_its_own(
    server: TestClient[Any, Any],
) -> None:
    full = _token()
    limited = _token("enqueue", sub_docs=["notes*"])
    other_limit = _token("enqueue", sub_docs=["jobs"])
    first = await _post(server, REQUESTS, BODY, full, "k-1")
    assert first[0] == 202
    assert first[2] is None
    as_limited = await _post(server, REQUESTS, BODY, limited, "k-1")
    assert as_limited[0] == 202
    assert as_limited[2] is None, "a full grant's answer replayed to a limited grant"
    assert as_limited[1]["request_id"] != first[1]["request_id"]
    as_other = await _post(server, REQUESTS, BODY, other_limit, "k-1")
    assert as_other[2] is None
    assert as_other[1]["request_id"] not in {first[1]["request_id"], as_limited[1]["request_id"]}

    # Under one grant the key still replays its own first answer, whichever token carries it.
    again = await _post(server, REQUESTS, BODY, _token("enqueue", sub_docs=["notes*"]), "k-1")
    assert (again[1], again[2]) == (as_limited[1], "true")
    full_again = await _post(server, REQUESTS, BODY, full, "k-1")
    assert (full_again[1], full_again[2]) == (first[1], "true")


async def test_a_batch_key_is_scoped_to_the_grant_too(server: TestClient[Any, Any]) -> None:
    path = f"{REQUESTS}/batch"
    full = await _post(server, path, BATCH, _token(), "b-1")
    limited = await _post(server, path, BATCH, _token("enqueue", "read"), "b-1")
    assert full[0] == limited[0] == 202
    assert limited[2] is None
    ids = [answer[1]["results"][0]["request_id"] for answer in (full, limited)]
    assert ids[0] != ids[1]
