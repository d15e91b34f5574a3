"""What aiohttp's HTTP parser refuses before the app sees it (an over-long header or request
line, a request that is not HTTP) is answered as problem+json with a code, by the server as
`cv-server serve` runs it, over raw HTTP on a real socket; and the server goes on serving."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cv_server import ServerConfig
from tests.server.conftest import SECRET, token_for
from tests.server.wire import RawAnswer, Served, post, raw_http, served


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Served]:
    async with served(ServerConfig(db_path=tmp_path / "cv.db", token_secret=SECRET)) as running:
        yield running


def _get(path: str, extra: str = "") -> bytes:
    return (
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token_for('ws1')}\r\n"
        f"{extra}Connection: close\r\n\r\n"
    ).encode("latin-1")


def _problem(answer: RawAnswer, code: str) -> None:
    assert answer.status == 400, answer
    assert answer.headers["content-type"].startswith("application/problem+json"), answer
    problem = answer.json()
    assert problem["code"] == code, problem
    assert problem["status"] == 400


async def _still_serves(server: Served) -> None:
    answer = await raw_http(server.port, _get("/healthz"))
    assert (answer.status, answer.json()) == (200, {"status": "ok"})


@pytest.mark.parametrize(
    "request_bytes",
    [
        post("/v1/workspaces/ws1/requests", b"{}", headers={"Idempotency-Key": "k" * 9000}),
        _get("/v1/workspaces/ws1/requests/" + "r" * 9000),
        _get("/v1/workspaces/ws1/docs/tree/ops?since=" + "1" * 20_000),
        _get("/healthz", extra=f"X-Long: {'v' * 100_000}\r\n"),
    ],
    ids=["9k-idempotency-key", "9k-request-id", "20k-request-line", "100k-header"],
)
async def test_a_line_past_the_parser_limit_is_answered_line_too_long(
    server: Served, request_bytes: bytes
) -> None:
    _problem(await raw_http(server.port, request_bytes), "line_too_long")
    await _still_serves(server)


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"BR\x00KEN / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\n\r\n",
        b"GET / HTTP/9.9\r\nHost: x\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,  # a TLS hello
    ],
    ids=["bad-method", "no-colon", "control-char", "bad-version", "two-lengths", "tls-hello"],
)
async def test_a_request_that_is_not_http_is_answered_malformed_request(
    server: Served, request_bytes: bytes
) -> None:
    _problem(await raw_http(server.port, request_bytes), "malformed_request")
    await _still_serves(server)


async def test_the_refusal_never_quotes_the_request(server: Served) -> None:
    """The offending line may carry a bearer token (a `?token=` on the socket route)."""
    token = token_for("ws1")
    answer = await raw_http(
        server.port, _get(f"/v1/workspaces/ws1/socket?token={token}&pad={'x' * 9000}")
    )
    _problem(answer, "line_too_long")
    assert token.encode() not in answer.body
