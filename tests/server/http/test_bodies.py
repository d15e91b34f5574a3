"""Content codings of request bodies, over raw HTTP on a real socket (aiohttp's client would
encode the body itself): which codings are accepted, and a clear 4xx problem+json with a stable
code, never a 500 and never an effect, for every body that is not what it claims."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import cv_server
from cv_mutations import new_op_id
from cv_server import ServerConfig
from cv_server.http.bodies import decode_body
from cv_server.http.problems import Problem
from cv_server.keys import STORES
from tests.server.conftest import SECRET
from tests.server.helpers import insert
from tests.server.wire import RawAnswer, Served, post, raw_http, served

OPS = "/v1/workspaces/ws1/docs/tree/ops"

#: Every route that reads a body, with a body it accepts (or refuses on its merits, after
#: reading it): the coding is judged first on all of them, by one reader.
BODY_ROUTES = [
    OPS,
    "/v1/workspaces/ws1/requests",
    "/v1/queue/claim",
    "/v1/queue/complete",
    "/v1/workspaces/ws1/requests/{id}/heartbeat",
    "/v1/workspaces/ws1/requests/{id}/complete",
    "/v1/workspaces/ws1/requests/{id}/fail",
    "/v1/workspaces/ws1/locks/acquire",
    "/v1/workspaces/ws1/locks/release",
]

LIMIT = 64 * 1024


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Served]:
    config = ServerConfig(db_path=tmp_path / "cv.db", token_secret=SECRET, max_body_bytes=LIMIT)
    async with served(config) as running:
        yield running


def _apply_body(node_id: str = "a") -> bytes:
    return json.dumps({"ops": [insert(node_id, op_id=new_op_id())]}).encode()


def _problem(answer: RawAnswer, status: int, code: str) -> None:
    assert answer.status == status, answer
    assert answer.headers["content-type"].startswith("application/problem+json"), answer
    assert answer.json()["code"] == code, answer


async def _clock(server: Served) -> int:
    head, _ = await server.app[STORES].oplog.read_since("ws1", "tree", 0, 1)
    return head


# -- what is accepted ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("coding", "encode"),
    [
        ("gzip", gzip.compress),
        ("x-gzip", gzip.compress),
        ("GZip", gzip.compress),
        ("deflate", zlib.compress),
        ("deflate", lambda data: zlib.compress(data, wbits=-zlib.MAX_WBITS)),  # raw deflate
        ("identity", lambda data: data),
        ("gzip, identity", gzip.compress),
    ],
    ids=["gzip", "x-gzip", "case", "deflate", "raw-deflate", "identity", "with-identity"],
)
async def test_an_accepted_coding_is_decoded_and_applied(
    server: Served, coding: str, encode: object
) -> None:
    assert callable(encode)
    body = _apply_body()
    answer = await raw_http(
        server.port, post(OPS, encode(body), headers={"Content-Encoding": coding})
    )
    assert answer.status == 200, answer
    assert answer.json()["results"][0]["clock"] == 1


async def test_two_gzip_members_are_one_body(server: Served) -> None:
    body = _apply_body()
    half = len(body) // 2
    encoded = gzip.compress(body[:half]) + gzip.compress(body[half:])
    answer = await raw_http(server.port, post(OPS, encoded, headers={"Content-Encoding": "gzip"}))
    assert answer.status == 200, answer
    assert await _clock(server) == 1


# -- what is refused, on every route that reads a body -------------------------------------------


REFUSED = [
    ("gzip", b"this is not gzip", 400, "malformed_body"),
    ("deflate", b"this is not deflate", 400, "malformed_body"),
    ("gzip", gzip.compress(b'{"ops": []}')[:-6], 400, "malformed_body"),  # truncated
    ("gzip", gzip.compress(b'{"ops": []}') + b"junk", 400, "malformed_body"),
    ("deflate", zlib.compress(b'{"ops": []}') + b"junk", 400, "malformed_body"),
    ("br", b"\x0b\x02\x80{}\x03", 415, "unsupported_content_encoding"),
    ("zstd", b"(\xb5/\xfd\x00\x00\x11\x00\x00{}", 415, "unsupported_content_encoding"),
    ("compress", b'{"ops": []}', 415, "unsupported_content_encoding"),
    (
        "gzip, gzip",
        gzip.compress(gzip.compress(b'{"ops": []}')),
        415,
        "unsupported_content_encoding",
    ),
]


@pytest.mark.parametrize("route", BODY_ROUTES)
async def test_a_body_that_is_not_what_its_coding_claims_gets_its_code_on_every_route(
    server: Served, route: str
) -> None:
    enqueued = await raw_http(server.port, post(BODY_ROUTES[1], b'{"stage": "s", "job_id": "j"}'))
    assert enqueued.status == 202, enqueued
    route = route.format(id=enqueued.json()["request_id"])
    for coding, body, status, code in REFUSED:
        answer = await raw_http(
            server.port, post(route, body, headers={"Content-Encoding": coding})
        )
        _problem(answer, status, code)
        if status == 415:  # RFC 9110 §15.5.16: say which codings would do
            assert answer.headers["accept-encoding"] == "gzip, deflate, identity"
    assert await _clock(server) == 0


async def test_a_gzip_bomb_is_refused_413_by_its_decoded_size(server: Served) -> None:
    bomb = gzip.compress(b" " * (32 * 1024 * 1024), compresslevel=9)  # 32 MiB in ~32 KiB
    assert len(bomb) < LIMIT
    answer = await raw_http(server.port, post(OPS, bomb, headers={"Content-Encoding": "gzip"}))
    _problem(answer, 413, "body_too_large")
    assert "decodes to more than" in answer.json()["detail"]


async def test_a_body_decoding_to_just_the_limit_is_read(server: Served) -> None:
    start = _apply_body()[:-1]  # one op; the padding goes before the closing brace
    body = start + b" " * (LIMIT - len(start) - 1) + b"}"
    assert len(body) == LIMIT
    answer = await raw_http(
        server.port, post(OPS, gzip.compress(body), headers={"Content-Encoding": "gzip"})
    )
    assert answer.status == 200, answer
    over = body + b" "
    answer = await raw_http(
        server.port, post(OPS, gzip.compress(over), headers={"Content-Encoding": "gzip"})
    )
    _problem(answer, 413, "body_too_large")


async def test_a_broken_chunked_body_gets_400_malformed_body(server: Served) -> None:
    head = post(OPS, b"").replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
    answer = await raw_http(server.port, head + b'5\r\n{"ops\r\nzz\r\n')
    assert answer.status == 400, answer
    assert answer.headers["content-type"].startswith("application/problem+json"), answer
    assert answer.json()["code"] in ("malformed_body", "malformed_request")
    assert await _clock(server) == 0


# -- the decoder alone -----------------------------------------------------------------------------


def test_decode_body_stops_at_the_limit_without_inflating_the_rest() -> None:
    bomb = zlib.compress(b"\0" * (16 * 1024 * 1024))
    with pytest.raises(Problem) as caught:
        decode_body("deflate", bomb, 1024)
    assert (caught.value.status, caught.value.code) == (413, "body_too_large")


def test_decode_body_round_trips_every_accepted_coding() -> None:
    data = b'{"ops": []}' * 100
    assert decode_body("gzip", gzip.compress(data), len(data)) == data
    assert decode_body("x-gzip", gzip.compress(data), len(data)) == data
    assert decode_body("deflate", zlib.compress(data), len(data)) == data
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert decode_body("deflate", raw.compress(data) + raw.flush(), len(data)) == data


def test_every_route_reads_its_body_through_read_body() -> None:
    """A route reading `request` itself would get the coded bytes (`auto_decompress` is off)
    and skip the decoded-size limit."""
    root = Path(cv_server.__file__).parent
    readers = (
        "request.read(",
        "request.text(",
        "request.json(",
        "request.post(",
        "request.content",
    )
    offenders = [
        f"{path.relative_to(root)}: {reader}"
        for path in root.rglob("*.py")
        if path.name != "bodies.py"
        for reader in readers
        if reader in path.read_text()
    ]
    assert offenders == []
