"""A problem's `type`: `about:blank` by default (RFC 9457's problem with no page of its own, the
code in `code`), never a relative reference a client would resolve against the request's URL; a
deployment that publishes docs/problems.md (one anchor per code: tests/test_docs.py checks the
anchors) sets its own base, and `type` is that base + the code."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import pytest

from cv_server import ServerConfig, create_app
from cv_server.cli import parse_overrides
from cv_server.http.problems import PROBLEM_BASE
from tests.server.conftest import SECRET, ClientFactory, auth
from tests.server.wire import raw_http, served


async def test_the_default_type_is_absolute_and_resolves_to_itself_from_any_url(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    client = await aiohttp_client(create_app(make_config()))
    resp = await client.post(
        "/v1/workspaces/w/docs/tree/ops",
        data=b"{",
        headers={**auth("w"), "Content-Type": "application/json"},
    )
    problem = await resp.json(content_type="application/problem+json")
    assert resp.status == 400
    assert problem["code"] == "malformed_json"
    assert problem["type"] == "about:blank"
    # What a client does with `type` (RFC 9457 §3.1.1): resolve it against the request's URL.
    assert urljoin(str(resp.url), problem["type"]) == "about:blank"
    assert ServerConfig().problem_type_base == PROBLEM_BASE == "about:blank"


async def test_a_deployment_sets_its_own_base_for_every_answer(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    base = "https://docs.example.com/cv/problems.md#"
    client = await aiohttp_client(create_app(make_config(problem_type_base=base)))
    missing = await client.get("/v1/no-such-route", headers=auth("w"))  # raised by aiohttp
    refused = await client.get("/v1/workspaces/w/docs/tree")  # raised by a handler: no token
    types: list[Any] = [
        (await missing.json(content_type=None))["type"],
        (await refused.json(content_type=None))["type"],
    ]
    assert types == [base + "not_found", base + "unauthorized"]


def test_serve_takes_the_base_with_set() -> None:
    base = "https://docs.example.com/cv/problems.md#"
    assert parse_overrides([f"problem_type_base={base}"]) == {"problem_type_base": base}


@pytest.mark.parametrize("base", ["", "docs/problems.md#\n"])
def test_a_base_that_cannot_prefix_a_uri_is_refused(base: str) -> None:
    with pytest.raises(ValueError, match="problem_type_base"):
        ServerConfig(problem_type_base=base)


async def test_a_parser_refusal_answered_outside_the_app_uses_the_base_too(tmp_path: Path) -> None:
    # An over-long request line never reaches the app's middleware: the runner answers it.
    base = "https://docs.example.com/cv/problems.md#"
    config = ServerConfig(db_path=tmp_path / "cv.db", token_secret=SECRET, problem_type_base=base)
    async with served(config) as server:
        request = f"GET /healthz?{'x' * 9000} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
        answer = await raw_http(server.port, request)
    assert answer.status == 400
    assert answer.json()["type"] == base + "line_too_long"
