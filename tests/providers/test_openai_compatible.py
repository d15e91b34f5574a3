"""`OpenAICompatibleProvider` against a fake OpenAI-compatible endpoint on 127.0.0.1.

Retries never wait: the provider's `sleep` is a recorder, so the tests assert the delays it asked
for instead of sitting through them.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from pytest_aiohttp import AiohttpServer

from cv_workspace_client.providers import (
    OpenAICompatibleProvider,
    Provider,
    ProviderError,
    ProviderRejected,
    ProviderResponseInvalid,
    ProviderRetry,
    ProviderUnavailable,
    RetryableStatus,
)

Step = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


def answer_for(prompt: str) -> str:
    return f"answer to {prompt!r}"


async def ok(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    prompt = body["messages"][-1]["content"]
    return web.json_response(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": answer_for(prompt)},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": 3, "total_tokens": 9},
        }
    )


def status(code: int, headers: dict[str, str] | None = None) -> Step:
    async def step(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response(
            {"error": {"message": f"status {code}"}}, status=code, headers=headers
        )

    return step


class FakeEndpoint:
    """Answers each POST with the next scripted step (`ok` once the script runs out) and records
    every request it saw."""

    def __init__(self) -> None:
        self.script: deque[Step] = deque()
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.base_url = ""
        #: Set at teardown so a step that hangs (to provoke a client timeout) can finish.
        self.release = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        step = self.script.popleft() if self.script else ok
        return await step(request, body)

    async def hang(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await self.release.wait()
        return await ok(request, body)

    @property
    def calls(self) -> int:
        return len(self.bodies)


class RecordingSleep:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


@pytest.fixture
async def endpoint(aiohttp_server: AiohttpServer) -> AsyncIterator[FakeEndpoint]:
    fake = FakeEndpoint()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.handle)
    server = await aiohttp_server(app, host="127.0.0.1")
    fake.base_url = str(server.make_url("/v1"))
    yield fake
    fake.release.set()


@pytest.fixture
def sleep() -> RecordingSleep:
    return RecordingSleep()


@pytest.fixture
async def provider(
    endpoint: FakeEndpoint, sleep: RecordingSleep
) -> AsyncIterator[OpenAICompatibleProvider]:
    async with OpenAICompatibleProvider(
        endpoint.base_url, "sk-test", model="test-model", timeout=5.0, sleep=sleep
    ) as provider:
        yield provider


# -- success --------------------------------------------------------------------------------------


async def test_a_successful_completion_is_parsed(
    provider: OpenAICompatibleProvider, endpoint: FakeEndpoint, sleep: RecordingSleep
) -> None:
    result = await provider.complete("score this job", temperature=0.1, max_tokens=20)
    assert result.text == answer_for("score this job")
    assert result.usage["prompt_tokens"] == len("score this job")
    assert result.raw["model"] == "test-model"
    assert endpoint.calls == 1
    assert sleep.delays == []
    sent = endpoint.bodies[0]
    assert sent["messages"] == [{"role": "user", "content": "score this job"}]
    assert (sent["temperature"], sent["max_tokens"]) == (0.1, 20)
    assert endpoint.headers[0]["Authorization"] == "Bearer sk-test"


async def test_a_model_given_to_complete_overrides_the_default(
    provider: OpenAICompatibleProvider, endpoint: FakeEndpoint
) -> None:
    await provider.complete("hi", model="other-model")
    assert endpoint.bodies[0]["model"] == "other-model"


async def test_no_authorization_header_is_sent_without_an_api_key(endpoint: FakeEndpoint) -> None:
    async with OpenAICompatibleProvider(endpoint.base_url, model="m") as provider:
        await provider.complete("hi")
    assert "Authorization" not in endpoint.headers[0]


async def test_the_provider_satisfies_the_provider_protocol(
    provider: OpenAICompatibleProvider,
) -> None:
    assert isinstance(provider, Provider)


# -- what is retried ------------------------------------------------------------------------------


async def test_a_500_then_200_is_retried_once_and_succeeds(
    provider: OpenAICompatibleProvider, endpoint: FakeEndpoint, sleep: RecordingSleep
) -> None:
    endpoint.script.append(status(500))
    result = await provider.complete("p")
    assert result.text == answer_for("p")
    assert endpoint.calls == 2
    assert len(sleep.delays) == 1
    assert 0 <= sleep.delays[0] <= provider.retry.base_seconds


async def test_a_429_retry_after_is_honoured(endpoint: FakeEndpoint, sleep: RecordingSleep) -> None:
    endpoint.script.append(status(429, {"Retry-After": "7"}))
    # uniform() == 0: full jitter alone would not wait at all, so the wait is the header's.
    async with OpenAICompatibleProvider(
        endpoint.base_url, model="m", sleep=sleep, uniform=lambda: 0.0
    ) as provider:
        result = await provider.complete("p")
    assert result.text == answer_for("p")
    assert endpoint.calls == 2
    assert len(sleep.delays) == 1
    assert sleep.delays[0] >= 7


async def test_a_400_is_not_retried_and_raises_provider_rejected(
    provider: OpenAICompatibleProvider, endpoint: FakeEndpoint, sleep: RecordingSleep
) -> None:
    endpoint.script.append(status(400))
    with pytest.raises(ProviderRejected) as caught:
        await provider.complete("p")
    assert caught.value.status == 400
    assert caught.value.code == "provider_rejected"
    assert "status 400" in caught.value.body
    assert endpoint.calls == 1
    assert sleep.delays == []


async def test_a_timeout_is_retried(endpoint: FakeEndpoint, sleep: RecordingSleep) -> None:
    endpoint.script.append(endpoint.hang)
    # The hang is cut by the timeout, and the retry's answer must come within it too: the
    # timeout leaves a loaded machine's loopback answer room (the loop's clock: none to inject).
    async with OpenAICompatibleProvider(
        endpoint.base_url, model="m", timeout=2.0, sleep=sleep
    ) as provider:
        result = await provider.complete("p")
    assert result.text == answer_for("p")
    assert endpoint.calls == 2
    assert len(sleep.delays) == 1


async def test_exhausted_retries_raise_provider_unavailable(
    endpoint: FakeEndpoint, sleep: RecordingSleep
) -> None:
    endpoint.script.extend(status(503) for _ in range(10))
    retry = ProviderRetry(attempts=4)
    async with OpenAICompatibleProvider(
        endpoint.base_url, model="m", sleep=sleep, retry=retry
    ) as provider:
        with pytest.raises(ProviderUnavailable) as caught:
            await provider.complete("p")
    assert endpoint.calls == 4
    assert len(sleep.delays) == 3
    assert caught.value.status == 503
    assert caught.value.attempts == 4
    assert caught.value.code == "provider_unavailable"
    assert isinstance(caught.value.__cause__, RetryableStatus)


async def test_the_default_policy_makes_five_attempts(
    provider: OpenAICompatibleProvider, endpoint: FakeEndpoint, sleep: RecordingSleep
) -> None:
    endpoint.script.extend(status(502) for _ in range(10))
    with pytest.raises(ProviderUnavailable):
        await provider.complete("p")
    assert endpoint.calls == 5
    assert len(sleep.delays) == 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_connection_errors_are_retried_then_raise_provider_unavailable(
    sleep: RecordingSleep,
) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    async with OpenAICompatibleProvider(
        url, model="m", sleep=sleep, retry=ProviderRetry(attempts=3)
    ) as provider:
        with pytest.raises(ProviderUnavailable) as caught:
            await provider.complete("p")
    assert len(sleep.delays) == 2
    assert caught.value.status is None
    assert isinstance(caught.value.__cause__, aiohttp.ClientConnectionError)


# -- what is not retried --------------------------------------------------------------------------


async def test_a_success_that_is_not_a_completion_raises_and_is_not_retried(
    provider: OpenAICompatibleProvider, endpoint: FakeEndpoint, sleep: RecordingSleep
) -> None:
    async def garbage(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response({"choices": []})

    endpoint.script.append(garbage)
    with pytest.raises(ProviderResponseInvalid) as caught:
        await provider.complete("p")
    assert caught.value.code == "provider_bad_response"
    assert endpoint.calls == 1
    assert sleep.delays == []


async def test_an_invalid_url_raises_a_provider_error_without_retrying(
    sleep: RecordingSleep,
) -> None:
    async with OpenAICompatibleProvider("not-a-url", model="m", sleep=sleep) as provider:
        with pytest.raises(ProviderError) as caught:
            await provider.complete("p")
    assert not isinstance(caught.value, ProviderUnavailable)
    assert sleep.delays == []


# -- session ownership ----------------------------------------------------------------------------


async def test_a_shared_session_is_left_open(endpoint: FakeEndpoint) -> None:
    async with aiohttp.ClientSession() as session:
        provider = OpenAICompatibleProvider(endpoint.base_url, model="m", session=session)
        await provider.complete("p")
        await provider.aclose()
        assert not session.closed
        assert (await provider.complete("q")).text == answer_for("q")
