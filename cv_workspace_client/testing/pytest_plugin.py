"""The pytest plugin: a `cv_server` fixture, a real `cv-server` process per test
(docs/client.md, "Testing your app").

pytest loads it from the `pytest11` entry point `cv_workspace` wherever cv-workspace is
installed; `-p no:cv_workspace` leaves it out. Importing it loads pytest and the SDK's test
helpers only: no server package, no asyncio plugin. The process starts when a test asks for
the fixture.

The fixture is synchronous and yields a started `LocalServer` (`url`, `token(...)`), so it
works under any async plugin (pytest-asyncio, pytest-aiohttp, anyio) and in plain tests alike.
Its SQLite file and log are in the test's `tmp_path` (`cv-server/cv.db`, `cv-server/server.log`).
An app that wants PostgreSQL, settings or a wider scope defines its own `cv_server` fixture in
its `conftest.py` around `LocalServer(...)`; that one wins over this one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cv_workspace_client.testing.local_server import LocalServer

__all__ = ["cv_server"]


@pytest.fixture
def cv_server(tmp_path: Path) -> Iterator[LocalServer]:
    """A real `cv-server` on a fresh SQLite file and a free loopback port, stopped after the
    test (SIGTERM, then SIGKILL after `stop_timeout`). `cv_server.token("ws1")` mints a token.
    """
    with LocalServer(tmp_path / "cv-server") as server:
        yield server
