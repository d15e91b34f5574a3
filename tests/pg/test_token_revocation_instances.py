"""A token revoked through instance A while its socket is open on instance B, both on one
PostgreSQL schema: B hears of it by NOTIFY (its poll is set far beyond the test's patience),
closes the socket with 4001, and both answer the token's next request 401 `token_revoked`
(docs/operating.md, "Revoking a token")."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import WSMsgType
from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.auth import verify_token
from cv_server.cli import _with_schema
from tests.server.conftest import SECRET, ClientFactory
from tests.server.test_token_revocation import WS, mint, status_of, subscribed_socket

pytestmark = pytest.mark.postgres

TIMEOUT = 30.0


@pytest.fixture
async def instances(
    aiohttp_client: ClientFactory, postgres_url: str, schema: str
) -> list[TestClient[Any, Any]]:
    config = ServerConfig(
        database_url=_with_schema(postgres_url, schema),
        token_secret=SECRET,
        revocation_poll_seconds=600,
        sweep_seconds=600,
    )
    return [await aiohttp_client(create_app(config)) for _ in range(2)]


async def test_a_token_revoked_through_one_instance_closes_its_socket_on_the_other(
    instances: list[TestClient[Any, Any]],
) -> None:
    a, b = instances
    token, other = mint(WS), mint(WS)
    ws = await subscribed_socket(b, token)
    closing = asyncio.create_task(ws.receive())
    token_id = verify_token(SECRET, token, now=0).token_id
    operator = mint("*", scopes=["operate"])
    answer = await a.post(
        f"/v1/tokens/{token_id}/revoke", headers={"Authorization": f"Bearer {operator}"}
    )
    assert answer.status == 200, await answer.text()
    async with asyncio.timeout(TIMEOUT):
        closed = await closing
    assert (closed.type, ws.close_code) == (WSMsgType.CLOSE, 4001)
    assert [await status_of(client, token) for client in instances] == [(401, "token_revoked")] * 2
    assert [await status_of(client, other) for client in instances] == [(200, None)] * 2
