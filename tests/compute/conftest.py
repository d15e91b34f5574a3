"""Fixtures: the real server in-process on loopback (with a request log), and SDK clients."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from cv_server import ServerConfig, create_app
from cv_server.keys import STORES
from cv_workspace_client import WorkspaceClient
from tests.clocks import SkippingClock

from .helpers import SECRET, WS, RequestLog, fast_config, token_for

ServerFactory = Callable[..., Awaitable[TestServer]]
StartServer = Callable[..., Awaitable[str]]
OpenClient = Callable[..., Awaitable[WorkspaceClient]]


@pytest.fixture
def request_log() -> RequestLog:
    return RequestLog()


@pytest.fixture
def lock_clock() -> SkippingClock:
    """The clock the compute locks of every server `start_server` starts are judged on: the
    test skips it a TTL ahead to lapse a holder's lock at the moment it chooses."""
    return SkippingClock()


@pytest.fixture
def start_server(
    aiohttp_server: ServerFactory,
    tmp_path: Path,
    request_log: RequestLog,
    lock_clock: SkippingClock,
    monkeypatch: pytest.MonkeyPatch,
) -> StartServer:
    """`await start_server(**config_overrides)` → the base URL of a fresh server (its compute
    locks judged on `lock_clock`)."""

    async def start(**overrides: Any) -> str:
        values: dict[str, Any] = {"db_path": tmp_path / "cv.db", "token_secret": SECRET}
        values.update(overrides)
        app = create_app(ServerConfig(**values))
        app.middlewares.insert(0, request_log.middleware)
        server = await aiohttp_server(app)
        lock_clock.drive(app[STORES].locks, monkeypatch)
        return str(server.make_url("")).rstrip("/")

    return start


@pytest.fixture
async def server_url(start_server: StartServer) -> str:
    return await start_server()


@pytest.fixture
async def open_client() -> AsyncIterator[OpenClient]:
    """`await open_client(url, *workspaces)` → a started client, closed at teardown."""
    async with AsyncExitStack() as stack:

        async def open_(url: str, *workspaces: str, **options: Any) -> WorkspaceClient:
            options.setdefault("config", fast_config())
            client = WorkspaceClient(url, token=token_for(*(workspaces or (WS,))), **options)
            return await stack.enter_async_context(client)

        yield open_
