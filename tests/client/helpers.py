"""Shared helpers for the client's tests: tokens, fast retry settings, reading the server."""

from __future__ import annotations

import time
from typing import Any

import aiohttp

from cv_server.auth import mint_token
from cv_workspace_client import ClientConfig, Subscription

SECRET = b"client-test-secret-0123456789abcdef"
WS = "ws1"


def token_for(*workspaces: str) -> str:
    return mint_token(SECRET, list(workspaces), now=time.time())


def fast_config(**overrides: Any) -> ClientConfig:
    """The default retry policy, shrunk from seconds to milliseconds for tests."""
    values: dict[str, Any] = {
        "retry_base_seconds": 0.005,
        "retry_cap_seconds": 0.05,
        "reconnect_after_drop_seconds": (0.01, 0.025),
    }
    values.update(overrides)
    return ClientConfig(**values)


class RecordingSleep:
    """An injected `sleep` that records the delays asked for and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


async def server_log(server_url: str, sub_doc: str, workspace: str = WS) -> list[dict[str, Any]]:
    """Every committed entry of a sub-doc, read straight from the server (no proxy, no SDK)."""
    headers = {"Authorization": f"Bearer {token_for(workspace)}"}
    entries: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as session:
        while True:
            url = f"{server_url}/v1/workspaces/{workspace}/docs/{sub_doc}/ops"
            params = {"since": str(entries[-1]["clock"] if entries else 0)}
            async with session.get(url, params=params, headers=headers) as response:
                assert response.status == 200, await response.text()
                page = (await response.json())["ops"]
            if not page:
                return entries
            entries.extend(page)


async def server_state(
    server_url: str, sub_doc: str, workspace: str = WS, token: str | None = None
) -> dict[str, Any]:
    """GET the sub-doc's state straight from the server (no proxy, no SDK); `token` for a
    server minted with another secret (a real `cv-server` process)."""
    headers = {"Authorization": f"Bearer {token or token_for(workspace)}"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"{server_url}/v1/workspaces/{workspace}/docs/{sub_doc}", headers=headers
        ) as response,
    ):
        assert response.status == 200, await response.text()
        body: dict[str, Any] = await response.json()
        return body


async def collect(sub: Subscription, until_clock: int) -> list[int]:
    """The clocks a subscription yields, up to and including the first at or past `until_clock`."""
    clocks: list[int] = []
    async for committed in sub:
        clocks.append(committed.clock)
        if committed.clock >= until_clock:
            break
    return clocks
