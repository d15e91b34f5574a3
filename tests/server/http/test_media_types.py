"""Every body is JSON, and a `Content-Type` that says otherwise is refused before a byte is read:
415 `unsupported_media_type` with `Accept: application/json`, nothing applied (docs/problems.md).
`application/json` and `+json` types are read, in UTF-8; so is a body with no `Content-Type`.

Raw HTTP over a real loopback socket: aiohttp's client would pick a `Content-Type` itself."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cv_mutations import new_op_id
from cv_server import ServerConfig
from cv_server.keys import STORES
from tests.server.conftest import SECRET, token_for
from tests.server.helpers import insert
from tests.server.wire import RawAnswer, Served, raw_http, served

OPS = "/v1/workspaces/ws1/docs/tree/ops"
ENQUEUE = "/v1/workspaces/ws1/requests"
ACQUIRE = "/v1/workspaces/ws1/locks/acquire"


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Served]:
    async with served(ServerConfig(db_path=tmp_path / "cv.db", token_secret=SECRET)) as running:
        yield running


def _request(path: str, body: bytes, content_type: str | None) -> bytes:
    """A POST with exactly this `Content-Type` (None: no such header at all)."""
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: 127.0.0.1",
        f"Authorization: Bearer {token_for('ws1')}",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if content_type is not None:
        lines.append(f"Content-Type: {content_type}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _apply_body() -> bytes:
    return json.dumps({"ops": [insert("a", op_id=new_op_id())]}).encode()


async def _head_clock(server: Served) -> int:
    clock, _ = await server.app[STORES].oplog.get_state("ws1", "tree")
    return clock


def _refused(answer: RawAnswer) -> None:
    assert answer.status == 415, answer
    assert answer.headers["content-type"].startswith("application/problem+json"), answer
    assert answer.json()["code"] == "unsupported_media_type", answer
    assert answer.headers["accept"] == "application/json", answer


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain; charset=utf-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/octet-stream",
        "application/json; charset=latin-1",
        "text/json",
    ],
)
async def test_a_body_that_says_it_is_not_json_is_refused_and_applies_nothing(
    server: Served, content_type: str
) -> None:
    answer = await raw_http(server.port, _request(OPS, _apply_body(), content_type))
    _refused(answer)
    assert await _head_clock(server) == 0


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON; charset=UTF-8",
        "application/merge-patch+json",
        None,
    ],
)
async def test_json_a_json_suffix_or_no_content_type_is_read(
    server: Served, content_type: str | None
) -> None:
    answer = await raw_http(server.port, _request(OPS, _apply_body(), content_type))
    assert answer.status == 200, answer
    assert await _head_clock(server) == 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (ENQUEUE, b'{"stage": "s"}'),
        (ACQUIRE, b'{"job_id": "j", "task": "t"}'),
    ],
)
async def test_every_body_route_refuses_text_plain(server: Served, path: str, body: bytes) -> None:
    _refused(await raw_http(server.port, _request(path, body, "text/plain")))
    assert (await raw_http(server.port, _request(path, body, "application/json"))).status < 300


def test_what_counts_as_json() -> None:
    from cv_server.http.bodies import is_json_media_type

    assert is_json_media_type("application/json", None)
    assert is_json_media_type("application/problem+json", "utf-8")
    assert not is_json_media_type("application/jsonx", None)
    assert not is_json_media_type("text/plain", None)
    assert not is_json_media_type("application/json", "utf-16")
