"""The counting fake provider endpoint, through the SDK's own OpenAI-compatible provider."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from cv_workspace_client.providers import OpenAICompatibleProvider, fake_answer
from cv_workspace_client.stages.enrich import commute_prompt, parse_minutes
from cv_workspace_client.stages.fake_provider import create_fake_provider_app, demo_answer

ServerFactory = Callable[..., Awaitable[TestServer]]


async def call(server: TestServer, method: str, path: str) -> Any:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, str(server.make_url(path))) as response,
    ):
        return await response.json()


async def test_it_answers_like_a_chat_endpoint_and_counts_every_call(
    aiohttp_server: ServerFactory,
) -> None:
    server = await aiohttp_server(create_fake_provider_app(delay=0.0))
    commute = commute_prompt("Paris", "J1", "Lyon")
    async with OpenAICompatibleProvider(str(server.make_url("/v1")), model="fake") as provider:
        first = await provider.complete("hello")
        again = await provider.complete("hello")
        minutes = await provider.complete(commute)

    assert first.text == again.text == fake_answer("hello")
    assert minutes.text == demo_answer(commute)
    assert parse_minutes(minutes.text) is not None
    stats = await call(server, "GET", "/stats")
    assert stats["calls"] == 3
    assert stats["by_prompt"] == {"hello": 2, commute: 1}
    assert stats["in_flight"] == 0

    await call(server, "POST", "/reset")
    assert (await call(server, "GET", "/stats"))["calls"] == 0
