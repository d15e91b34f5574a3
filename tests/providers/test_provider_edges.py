"""`OpenAICompatibleProvider` against a misbehaving endpoint on 127.0.0.1, and the shipped
`evaluate` stage run by a real `Worker` over it: every bad answer becomes a typed
`ProviderError` with a readable message, never the API key, and the stage fails the documented
way (the queue re-drives it, then poison) while the worker keeps running.

Retries never wait (the provider's `sleep` is a recorder); timeouts are shrunk to tenths of a
second and every hanging handler is released at teardown.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from pytest_aiohttp import AiohttpServer

from cv_workspace_client import WorkspaceClient
from cv_workspace_client.providers import (
    OpenAICompatibleProvider,
    ProviderError,
    ProviderRejected,
    ProviderResponseInvalid,
    ProviderRetry,
    ProviderUnavailable,
    RetryableStatus,
)
from cv_workspace_client.stages import STAGES
from cv_workspace_client.stages.jobs import JOBS
from cv_workspace_client.worker import Worker, WorkerConfig
from tests.worker.conftest import (  # noqa: F401  (make_server is a fixture)
    WS,
    MakeServer,
    make_server,
    running,
    token_for,
)

KEY = "sk-live-SECRET-0123456789"

Step = Callable[[web.Request], Awaitable[web.StreamResponse]]


def completion(text: str = "an answer") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1},
    }


async def ok(request: web.Request) -> web.StreamResponse:
    return web.json_response(completion())


def raw(status: int, body: bytes, content_type: str = "application/json") -> Step:
    async def step(request: web.Request) -> web.StreamResponse:
        return web.Response(status=status, body=body, content_type=content_type)

    return step


class Endpoint:
    """Answers each POST with the next scripted step (`default` once the script runs out)."""

    def __init__(self) -> None:
        self.script: deque[Step] = deque()
        self.default: Step = ok
        self.calls = 0
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()
        self.base_url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.calls += 1
        self.arrived.set()
        step = self.script.popleft() if self.script else self.default
        return await step(request)

    async def hang(self, request: web.Request) -> web.StreamResponse:
        await self.release.wait()
        return await ok(request)

    async def trickle(self, request: web.Request) -> web.StreamResponse:
        """Headers and one byte of a 200, then nothing until teardown."""
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b"{")
        await self.release.wait()
        return response

    async def echo_key(self, request: web.Request) -> web.StreamResponse:
        """What some providers do: quote the key they refused."""
        sent = request.headers.get("Authorization", "")
        return web.json_response({"error": {"message": f"invalid key: {sent}"}}, status=401)


class RecordingSleep:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


@pytest.fixture
async def endpoint(aiohttp_server: AiohttpServer) -> AsyncIterator[Endpoint]:
    fake = Endpoint()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.handle)
    app.router.add_post("/loop/chat/completions", _redirect_to_itself)
    test_server = await aiohttp_server(app, host="127.0.0.1")
    fake.base_url = str(test_server.make_url("/v1"))
    yield fake
    fake.release.set()


async def _redirect_to_itself(request: web.Request) -> web.StreamResponse:
    raise web.HTTPTemporaryRedirect(request.path)  # 307: the POST and its Authorization resent


@pytest.fixture
def sleep() -> RecordingSleep:
    return RecordingSleep()


def provider_for(
    endpoint: Endpoint, sleep: RecordingSleep, *, attempts: int = 3, **kwargs: Any
) -> OpenAICompatibleProvider:
    return OpenAICompatibleProvider(
        kwargs.pop("base_url", endpoint.base_url),
        KEY,
        model="m",
        sleep=sleep,
        retry=ProviderRetry(attempts=attempts),
        **{"timeout": 5.0, **kwargs},
    )


def assert_no_key(exc: BaseException) -> None:
    """Neither the error nor anything chained to it shows the key, as str or repr."""
    seen: BaseException | None = exc
    while seen is not None:
        assert KEY not in str(seen), seen
        assert KEY not in repr(seen), repr(seen)
        if isinstance(seen, ProviderRejected):
            assert KEY not in seen.body
        if isinstance(seen, RetryableStatus):
            assert KEY not in seen.body
        seen = seen.__cause__


# -- the API key never shows --------------------------------------------------------------------


async def test_a_redirect_loop_fails_typed_without_the_authorization_header_in_the_message(
    endpoint: Endpoint, sleep: RecordingSleep
) -> None:
    base = endpoint.base_url.removesuffix("/v1") + "/loop"
    async with provider_for(endpoint, sleep, base_url=base) as provider:
        with pytest.raises(ProviderError) as caught:
            await provider.complete("p")
    assert caught.value.code == "provider_error"
    assert "TooManyRedirects" in caught.value.message
    assert KEY not in caught.value.message
    assert KEY not in repr(caught.value)
    assert sleep.delays == []


async def test_a_key_echoed_in_a_401_is_not_in_the_rejection(
    endpoint: Endpoint, sleep: RecordingSleep
) -> None:
    endpoint.script.append(endpoint.echo_key)
    async with provider_for(endpoint, sleep) as provider:
        with pytest.raises(ProviderRejected) as caught:
            await provider.complete("p")
    assert caught.value.status == 401
    assert "invalid key" in caught.value.message
    assert_no_key(caught.value)
    assert endpoint.calls == 1


async def test_a_key_echoed_in_every_5xx_is_not_in_provider_unavailable(
    endpoint: Endpoint, sleep: RecordingSleep
) -> None:
    async def echo_503(request: web.Request) -> web.StreamResponse:
        return web.Response(status=503, text=f"overloaded, {request.headers['Authorization']}")

    endpoint.default = echo_503
    async with provider_for(endpoint, sleep, attempts=2) as provider:
        with pytest.raises(ProviderUnavailable) as caught:
            await provider.complete("p")
    assert "overloaded" in caught.value.message
    assert_no_key(caught.value)
    assert endpoint.calls == 2


async def test_a_key_echoed_in_a_malformed_success_is_not_in_the_bad_response(
    endpoint: Endpoint, sleep: RecordingSleep
) -> None:
    async def echo_200(request: web.Request) -> web.StreamResponse:
        return web.Response(text=f"<html>{request.headers['Authorization']}</html>")

    endpoint.script.append(echo_200)
    async with provider_for(endpoint, sleep) as provider:
        with pytest.raises(ProviderResponseInvalid) as caught:
            await provider.complete("p")
    assert "<html>" in caught.value.message
    assert_no_key(caught.value)


# -- bodies that are not what they claim ----------------------------------------------------------


async def test_a_5xx_with_a_body_that_is_not_utf8_is_retried_and_typed(
    endpoint: Endpoint, sleep: RecordingSleep
) -> None:
    endpoint.default = raw(502, b"\xff\xfe\x00 bad gateway", "text/html")
    async with provider_for(endpoint, sleep, attempts=3) as provider:
        with pytest.raises(ProviderUnavailable) as caught:
            await provider.complete("p")
    assert caught.value.status == 502
    assert "bad gateway" in caught.value.message
    assert endpoint.calls == 3
    assert len(sleep.delays) == 2


async def test_a_4xx_with_a_body_that_is_not_utf8_is_rejected_once(
    endpoint: Endpoint, sleep: RecordingSleep
) -> None:
    endpoint.script.append(raw(403, b"\x80\x81 forbidden", "text/plain"))
    async with provider_for(endpoint, sleep) as provider:
        with pytest.raises(ProviderRejected) as caught:
            await provider.complete("p")
    assert caught.value.status == 403
    assert "forbidden" in caught.value.body
    assert endpoint.calls == 1
    assert sleep.delays == []


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"<html>502 Bad Gateway</html>", id="html"),
        pytest.param(b"", id="empty"),
        pytest.param(b"null", id="null"),
        pytest.param(b"[1, 2]", id="list"),
        pytest.param(b'{"choices": [{"message": {"content": null}}]}', id="null-content"),
        pytest.param(b'{"choices": [{"message": {"content": ["a"]}}]}', id="list-content"),
        pytest.param(b'{"choices": {"0": 1}}', id="choices-object"),
        pytest.param(b"\xff\xfe not utf-8", id="not-utf8"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="nested-100k-deep"),
    ],
)
async def test_a_success_that_is_not_a_completion_is_a_typed_bad_response_never_retried(
    endpoint: Endpoint, sleep: RecordingSleep, body: bytes
) -> None:
    endpoint.script.append(raw(200, body))
    async with provider_for(endpoint, sleep) as provider:
        with pytest.raises(ProviderResponseInvalid) as caught:
            await provider.complete("p")
    assert caught.value.code == "provider_bad_response"
    assert caught.value.status == 200
    assert len(caught.value.message) < 2_000  # an excerpt, not the body
    assert endpoint.calls == 1
    assert sleep.delays == []


async def test_a_success_larger_than_the_cap_is_refused_without_retrying(
    endpoint: Endpoint, sleep: RecordingSleep
) -> None:
    big = completion("x" * 200_000)

    async def huge(request: web.Request) -> web.StreamResponse:
        return web.json_response(big)

    endpoint.script.append(huge)
    async with provider_for(endpoint, sleep, max_response_bytes=64 * 1024) as provider:
        with pytest.raises(ProviderResponseInvalid) as caught:
            await provider.complete("p")
        assert "larger than" in caught.value.message
        # The same answer under the cap is fine.
        endpoint.script.append(huge)
    async with provider_for(endpoint, sleep, max_response_bytes=1024 * 1024) as provider:
        assert (await provider.complete("p")).text == "x" * 200_000
    assert endpoint.calls == 2
    assert sleep.delays == []


async def test_an_endless_success_body_stops_at_the_cap_long_before_the_timeout(
    endpoint: Endpoint, sleep: RecordingSleep
) -> None:
    sent = 0

    async def endless(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        chunk = b"[" * 65536
        try:
            while sent < 256 * 1024 * 1024 and not endpoint.release.is_set():  # bounded anyway
                await response.write(chunk)
                sent += len(chunk)
        except (ConnectionError, RuntimeError):
            pass  # the client hung up: what the cap is for
        return response

    endpoint.script.append(endless)
    started = time.monotonic()
    async with provider_for(
        endpoint, sleep, max_response_bytes=1024 * 1024, timeout=60.0
    ) as provider:
        with pytest.raises(ProviderResponseInvalid):
            await provider.complete("p")
    assert time.monotonic() - started < 30
    assert sent < 64 * 1024 * 1024
    assert endpoint.calls == 1


async def test_a_huge_5xx_body_is_read_only_in_part(
    endpoint: Endpoint, sleep: RecordingSleep
) -> None:
    endpoint.script.append(raw(500, b"e" * (8 * 1024 * 1024), "text/plain"))
    async with provider_for(endpoint, sleep) as provider:
        result = await provider.complete("p")  # retried, then answered
    assert result.text == "an answer"
    assert endpoint.calls == 2
    assert len(sleep.delays) == 1


async def test_exhausted_retries_on_a_huge_5xx_keep_only_an_excerpt(
    endpoint: Endpoint, sleep: RecordingSleep
) -> None:
    endpoint.default = raw(500, b"e" * (8 * 1024 * 1024), "text/plain")
    # With a cap set, the error page is read only up to it; the message keeps an excerpt.
    async with provider_for(
        endpoint, sleep, attempts=2, max_response_bytes=1024 * 1024
    ) as provider:
        with pytest.raises(ProviderUnavailable) as caught:
            await provider.complete("p")
    cause = caught.value.__cause__
    assert isinstance(cause, RetryableStatus)
    assert len(cause.body) <= 1024 * 1024 + 1
    assert len(caught.value.message) < 2_000


async def test_a_body_cut_short_is_retried(endpoint: Endpoint, sleep: RecordingSleep) -> None:
    async def cut(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "application/json", "Content-Length": "1000"}
        )
        await response.prepare(request)
        await response.write(b'{"choices": [')
        assert request.transport is not None
        request.transport.close()
        return response

    endpoint.script.append(cut)
    async with provider_for(endpoint, sleep) as provider:
        assert (await provider.complete("p")).text == "an answer"
    assert endpoint.calls == 2
    assert len(sleep.delays) == 1


# -- time bounds ----------------------------------------------------------------------------------


async def test_a_provider_that_always_hangs_is_bounded_in_time_and_attempts(
    endpoint: Endpoint, sleep: RecordingSleep
) -> None:
    endpoint.default = endpoint.hang
    started = time.monotonic()
    async with provider_for(endpoint, sleep, attempts=3, timeout=0.2) as provider:
        with pytest.raises(ProviderUnavailable) as caught:
            await provider.complete("p")
    assert time.monotonic() - started < 10
    assert endpoint.calls == 3
    assert caught.value.attempts == 3
    assert caught.value.status is None
    assert isinstance(caught.value.__cause__, TimeoutError)
    # str(TimeoutError()) is empty: the message must still say what went wrong.
    assert "Timeout" in caught.value.message


async def test_a_body_that_stalls_after_the_headers_is_cut_by_the_timeout_and_retried(
    endpoint: Endpoint, sleep: RecordingSleep
) -> None:
    endpoint.script.append(endpoint.trickle)
    started = time.monotonic()
    # The retry's answer must come within the timeout too: room for a loaded machine's loopback.
    async with provider_for(endpoint, sleep, timeout=2.0) as provider:
        assert (await provider.complete("p")).text == "an answer"
    assert time.monotonic() - started < 10
    assert endpoint.calls == 2
    assert len(sleep.delays) == 1


async def test_a_429_retry_after_http_date_is_honoured_against_the_injected_clock(
    endpoint: Endpoint, sleep: RecordingSleep
) -> None:
    now = 1_700_000_000.0
    when = email.utils.formatdate(now + 42, usegmt=True)

    async def limited(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": "slow down"}, status=429, headers={"Retry-After": when})

    endpoint.script.append(limited)
    async with provider_for(endpoint, sleep, uniform=lambda: 0.0, clock=lambda: now) as provider:
        assert (await provider.complete("p")).text == "an answer"
    assert sleep.delays == [42.0]


async def test_a_retry_after_beyond_the_cap_waits_the_cap_not_the_header(
    endpoint: Endpoint, sleep: RecordingSleep
) -> None:
    async def limited(request: web.Request) -> web.StreamResponse:
        return web.json_response({}, status=429, headers={"Retry-After": "86400"})

    endpoint.script.append(limited)
    retry = ProviderRetry(base_seconds=1.0, cap_seconds=30.0, attempts=3)
    async with OpenAICompatibleProvider(
        endpoint.base_url, KEY, model="m", sleep=sleep, retry=retry, uniform=lambda: 0.0
    ) as provider:
        await provider.complete("p")
    assert sleep.delays == [30.0]


@pytest.mark.parametrize("status", [401, 403, 404, 409, 413, 422])
async def test_no_4xx_but_429_is_retried(
    endpoint: Endpoint, sleep: RecordingSleep, status: int
) -> None:
    endpoint.default = raw(status, b'{"error": "no"}')
    async with provider_for(endpoint, sleep) as provider:
        with pytest.raises(ProviderRejected) as caught:
            await provider.complete("p")
    assert caught.value.status == status
    assert endpoint.calls == 1
    assert sleep.delays == []


def test_a_nonsensical_response_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="max_response_bytes"):
        OpenAICompatibleProvider("http://127.0.0.1:1/v1", model="m", max_response_bytes=0)


# -- the shipped stage over a failing provider ----------------------------------------------------

FAST = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05)


@pytest.mark.parametrize(
    ("step", "code"),
    [
        pytest.param("echo_key", "provider_rejected", id="401-echoing-the-key"),
        pytest.param("html", "provider_bad_response", id="html-200"),
        pytest.param("nested", "provider_bad_response", id="nested-json-200"),
    ],
)
async def test_evaluate_over_a_failing_provider_fails_to_poison_and_the_worker_runs_on(
    make_server: MakeServer,  # noqa: F811
    endpoint: Endpoint,
    caplog: pytest.LogCaptureFixture,
    step: str,
    code: str,
) -> None:
    steps: dict[str, Step] = {
        "echo_key": endpoint.echo_key,
        "html": raw(200, b"<html>oops</html>", "text/html"),
        "nested": raw(200, b"[" * 50_000 + b"]" * 50_000),
    }
    endpoint.script.append(steps[step])
    test_server: TestServer = await make_server(failure_backoff_seconds=0.0)
    url = str(test_server.make_url("")).rstrip("/")
    caplog.set_level(logging.DEBUG)
    sleep = RecordingSleep()
    async with (
        WorkspaceClient(url, token=token_for(WS)) as ws_client,
        OpenAICompatibleProvider(
            endpoint.base_url, KEY, model="m", sleep=sleep, retry=ProviderRetry(attempts=2)
        ) as provider,
    ):
        worker = Worker(ws_client, STAGES, provider=provider, config=FAST)
        async with running(worker) as task:
            bad = await ws_client.enqueue(
                WS, stage="evaluate", job_id="J1", input={"columns": ["fit"]}, max_dequeues=1
            )
            failed = await ws_client.wait_request(WS, bad.request_id, timeout=30)
            # The worker survived the failure: the next request (the provider now answers) runs.
            good = await ws_client.enqueue(
                WS, stage="evaluate", job_id="J2", input={"columns": ["fit"]}
            )
            done = await ws_client.wait_request(WS, good.request_id, timeout=30)
            assert not task.done()
        _, state = await ws_client.get_state(WS, JOBS)
    assert failed.status == "poison"
    assert failed.error is not None
    assert failed.error["code"] == code
    assert KEY not in str(failed.error)
    assert done.ok
    assert done.result["values"] == {"fit": "an answer"}
    assert "eval:fit" not in state.nodes["J1"].fields  # nothing written for the failed cell
    assert state.nodes["J2"].fields["eval:fit"] == "an answer"
    assert endpoint.calls == 2  # a 4xx or a malformed answer is paid once, not retried
    assert sleep.delays == []
    assert worker.stats.failed == 1
    assert worker.stats.completed == 1
    assert KEY not in caplog.text


async def test_a_hanging_provider_fails_the_stage_within_its_retry_budget(
    make_server: MakeServer,  # noqa: F811
    endpoint: Endpoint,
) -> None:
    endpoint.default = endpoint.hang
    test_server: TestServer = await make_server(failure_backoff_seconds=0.0)
    url = str(test_server.make_url("")).rstrip("/")
    sleep = RecordingSleep()
    provider = OpenAICompatibleProvider(
        endpoint.base_url, KEY, model="m", timeout=0.2, sleep=sleep, retry=ProviderRetry(attempts=2)
    )
    async with (
        WorkspaceClient(url, token=token_for(WS)) as ws_client,
        provider,
        running(Worker(ws_client, STAGES, provider=provider, config=FAST)),
    ):
        answer = await ws_client.enqueue(
            WS, stage="evaluate", job_id="J1", input={"columns": ["fit"]}, max_dequeues=1
        )
        outcome = await ws_client.wait_request(WS, answer.request_id, timeout=30)
    assert outcome.status == "poison"
    assert outcome.error is not None
    assert outcome.error["code"] == "provider_unavailable"
    assert "Timeout" in outcome.error["message"]
    assert endpoint.calls == 2
    assert len(sleep.delays) == 1
