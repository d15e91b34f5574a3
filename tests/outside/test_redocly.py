"""Redocly's linter, as an API team runs it on the server's own `/openapi.json`, with its
recommended rules: no error. One warning is kept, and only that one: the websocket route has no
2xx answer (`operation-2xx-response`), since a websocket handshake succeeds with
`101 Switching Protocols` and declaring a 2xx it never sends would be false
(docs/observability.md, "The API document")."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from cv_server import ServerConfig
from tests.outside.served_document import fetch_document, run
from tests.server.conftest import SECRET
from tests.server.wire import Served, served

pytestmark = pytest.mark.integration

SOCKET_ANSWERS = "#/paths/~1v1~1workspaces~1{ws}~1socket/get/responses"
CHANNEL_ANSWERS = "#/paths/~1v1~1queue~1channel/get/responses"


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Served]:
    async with served(ServerConfig(db_path=tmp_path / "cv.db", token_secret=SECRET)) as running:
        yield running


async def test_redocly_lint_finds_no_error_and_only_the_websocket_warnings(
    server: Served, tmp_path: Path, node_tool: Callable[[str], Path]
) -> None:
    redocly = node_tool("redocly")
    document = await fetch_document(server, tmp_path)
    ran = await run([redocly, "lint", document, "--format=json"], cwd=tmp_path)
    assert ran.returncode == 0, ran.output
    report = json.loads(ran.stdout)
    assert report["totals"]["errors"] == 0, report
    kept = [
        (problem["ruleId"], problem["location"][0]["pointer"]) for problem in report["problems"]
    ]
    # The two websocket routes answer their handshake 101: declaring a 2xx would be false.
    assert sorted(kept) == sorted(
        [("operation-2xx-response", CHANNEL_ANSWERS), ("operation-2xx-response", SOCKET_ANSWERS)]
    ), report
