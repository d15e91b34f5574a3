"""Fixtures for the client's tests through the real server on loopback."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from cv_server import ServerConfig, create_app

from .helpers import SECRET, WS, token_for

ServerFactory = Callable[..., Awaitable[TestServer]]


@pytest.fixture
async def server(aiohttp_server: ServerFactory, tmp_path: Path) -> TestServer:
    config = ServerConfig(db_path=tmp_path / "server.db", token_secret=SECRET)
    return await aiohttp_server(create_app(config))


@pytest.fixture
def server_url(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


@pytest.fixture
def token() -> str:
    return token_for(WS)
