"""Fixtures for the worker's tests: a real server in-process on loopback, real `WorkspaceClient`s,
and a worker run in the background that is always stopped (and drained) at the end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from cv_server import ServerConfig, create_app
from cv_server.auth import mint_token
from cv_server.keys import WORK_SIGNALS
from cv_workspace_client import ClientConfig, WorkspaceClient
from cv_workspace_client.worker import Worker, WorkerStats

SECRET = b"worker-test-secret-0123456789abcdef"
WS = "ws1"

ServerFactory = Callable[..., Awaitable[TestServer]]
MakeServer = Callable[..., Awaitable[TestServer]]


def token_for(*workspaces: str) -> str:
    return mint_token(SECRET, list(workspaces or (WS,)), now=time.time())


def fast_client_config() -> ClientConfig:
    """The default retry policy, shrunk from seconds to milliseconds."""
    return ClientConfig(retry_base_seconds=0.005, retry_cap_seconds=0.05)


@pytest.fixture(autouse=True, params=["channel", "http"])
def worker_transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every worker test runs over both transports: the worker channel and the HTTP verbs
    (`WorkerConfig.transport` follows `CV_WORKER_TRANSPORT`)."""
    transport = str(request.param)
    monkeypatch.setenv("CV_WORKER_TRANSPORT", transport)
    return transport


@pytest.fixture
def make_server(aiohttp_server: ServerFactory, tmp_path: Path) -> MakeServer:
    """A real server on loopback; keyword arguments override `ServerConfig` fields."""

    async def make(**overrides: Any) -> TestServer:
        values: dict[str, Any] = {"db_path": tmp_path / "server.db", "token_secret": SECRET}
        values.update(overrides)
        return await aiohttp_server(create_app(ServerConfig(**values)))

    return make


@pytest.fixture
async def server(make_server: MakeServer) -> TestServer:
    return await make_server()


def url_of(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


@asynccontextmanager
async def open_client(server: TestServer) -> AsyncIterator[WorkspaceClient]:
    async with WorkspaceClient(
        url_of(server), token=token_for(WS), config=fast_client_config()
    ) as client:
        yield client


@pytest.fixture
async def client(server: TestServer) -> AsyncIterator[WorkspaceClient]:
    async with open_client(server) as opened:
        yield opened


@asynccontextmanager
async def running(
    worker: Worker, *, stop_within: float = 30.0
) -> AsyncIterator[asyncio.Task[WorkerStats]]:
    """Run `worker` in the background; on exit stop it and wait (bounded) for its drain."""
    task = asyncio.create_task(worker.run())
    try:
        yield task
    finally:
        worker.stop()
        await asyncio.wait_for(asyncio.shield(task), stop_within)


async def long_polls_registered(server: TestServer, count: int, within: float = 10.0) -> None:
    """Wait until `count` idle long polls are parked on the server (a state, not a duration)."""
    assert server.app is not None
    async with asyncio.timeout(within):
        while len(server.app[WORK_SIGNALS]._sleepers) < count:  # noqa: ASYNC110  (a state)
            await asyncio.sleep(0.005)
