"""Fixtures for integration tests through real HTTP and websockets on loopback."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.auth import mint_token
from cv_server.cli import _with_schema
from tests.pg.helpers import fresh_schema

SECRET = b"integration-test-secret-0123456789"

ClientFactory = Callable[..., Awaitable[TestClient[Any, Any]]]


def token_for(*workspaces: str) -> str:
    return mint_token(SECRET, list(workspaces), now=time.time())


def auth(*workspaces: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token_for(*workspaces)}"}


@pytest.fixture
def make_config(tmp_path: Path) -> Callable[..., ServerConfig]:
    def make(**overrides: Any) -> ServerConfig:
        values: dict[str, Any] = {"db_path": tmp_path / "cv.db", "token_secret": SECRET}
        values.update(overrides)
        return ServerConfig(**values)

    return make


@pytest.fixture
async def client(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> TestClient[Any, Any]:
    return await aiohttp_client(create_app(make_config()))


BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture
async def server(
    aiohttp_client: ClientFactory, make_server_config: Callable[..., ServerConfig]
) -> TestClient[Any, Any]:
    """A server on loopback, on each backend in turn (`make_server_config`)."""
    return await aiohttp_client(create_app(make_server_config()))


@pytest.fixture(params=BACKENDS)
async def make_server_config(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Callable[..., ServerConfig]]:
    """A config factory for the backend under test, SQLite or PostgreSQL (a fresh schema per
    test): for tests that must hold on both."""
    if request.param == "sqlite":

        def make_sqlite(**overrides: Any) -> ServerConfig:
            return ServerConfig(db_path=tmp_path / "cv.db", token_secret=SECRET, **overrides)

        yield make_sqlite
        return
    postgres_url: str = request.getfixturevalue("postgres_url")
    async with fresh_schema(postgres_url) as schema:

        def make_postgres(**overrides: Any) -> ServerConfig:
            return ServerConfig(
                database_url=_with_schema(postgres_url, schema), token_secret=SECRET, **overrides
            )

        yield make_postgres
