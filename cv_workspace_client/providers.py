"""Providers: the expensive third-party call a stage makes under a compute lock (docs/concepts.md,
docs/stages.md).

`Provider` is the seam a stage handler sees. One implementation ships here:

- `OpenAICompatibleProvider`: HTTP JSON against an OpenAI-compatible `chat/completions` endpoint,
  retrying only what a retry can fix (429, 5xx, connection errors, timeouts) with full jitter
  (the client's retry policy, docs/client.md); any other 4xx is the caller's bug and raises at once.

Its test fake, `cv_workspace_client.testing.CountingFakeProvider`, gives deterministic answers
(`fake_answer`) and exact call counts, for tests and benchmarks (the number the whole project
exists to keep low: provider calls per cell).

The retry decision (`is_retryable`) and the delay (`retry_delay`) are pure functions; the HTTP
shell only wires them into tenacity with an injectable `sleep`, so tests never wait.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import json
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

import aiohttp
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt

from cv_workspace_client.config import ClientConfig
from cv_workspace_client.errors import WorkspaceError

__all__ = [
    "DEFAULT_PROVIDER_TIMEOUT_SECONDS",
    "MeteredProvider",
    "OpenAICompatibleProvider",
    "Provider",
    "ProviderError",
    "ProviderRejected",
    "ProviderResponseInvalid",
    "ProviderResult",
    "ProviderRetry",
    "ProviderUnavailable",
    "RetryableStatus",
    "default_model",
    "fake_answer",
    "is_retryable",
    "parse_retry_after",
    "retry_delay",
]

_log = logging.getLogger("cv_workspace_client.providers")

#: One compute-lock TTL (docs/configuration.md, docs/stages.md): a call that outlives the lock it
#: runs under can be duplicated by whoever takes the expired lock over.
DEFAULT_PROVIDER_TIMEOUT_SECONDS = 60.0

#: How much of an error body is kept in an exception message.
_BODY_EXCERPT = 500

_REDACTED = "[redacted]"


@dataclass(frozen=True, slots=True)
class ProviderResult:
    """One completion: the answer `text`, the provider's JSON as received, its token `usage`."""

    text: str
    raw: dict[str, Any]
    usage: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Provider(Protocol):
    """The expensive call. Implementations must be safe to call concurrently."""

    async def complete(
        self, prompt: str, *, model: str | None = None, **params: Any
    ) -> ProviderResult:
        """Answer `prompt`; `params` pass through to the provider (temperature, max_tokens…)."""
        ...


def default_model(provider: object) -> str | None:
    """The model `provider` calls when a stage names none: its `model` attribute
    (`OpenAICompatibleProvider(model=...)`, `cv-worker --model`), or None if it has none."""
    model = getattr(provider, "model", None)
    return model if isinstance(model, str) else None


class MeteredProvider:
    """`provider`, counted and timed: the worker wraps its provider in one per run, reports
    `calls` and `seconds` with the run's telemetry (`cv_provider_calls_total{stage}` and
    `cv_provider_seconds` on the server) and logs each call (never its prompt or answer) with
    the model it asked for: the stage's `model=`, else the provider's own
    (tests/cli/test_worker_provider_log.py)."""

    def __init__(self, provider: Provider) -> None:
        self.provider = provider
        self.calls = 0
        self.seconds = 0.0

    async def complete(
        self, prompt: str, *, model: str | None = None, **params: Any
    ) -> ProviderResult:
        self.calls += 1
        started = time.perf_counter()
        outcome = "error"
        try:
            result = await self.provider.complete(prompt, model=model, **params)
            outcome = "ok"
            return result
        finally:
            took = time.perf_counter() - started
            self.seconds += took
            _log.info(
                "provider call %s in %.1f ms",
                outcome,
                took * 1000,
                extra={
                    "event": "provider_call",
                    "outcome": outcome,
                    "duration_ms": round(took * 1000, 3),
                    "model": model or default_model(self.provider),
                },
            )


# -- errors ---------------------------------------------------------------------------------------


class ProviderError(WorkspaceError):
    """Base of every provider failure; `code` is stable, `status` the last HTTP status if any.

    Never `retryable` at the SDK level: the provider already spent its own retry budget, and
    retrying on top would multiply attempts (and the bill). A stage that fails with it is
    re-driven by the queue's backoff instead.
    """

    code = "provider_error"

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(type(self).code, message)
        self.status = status


class ProviderRejected(ProviderError):
    """The provider refused the request (a 4xx other than 429). Never retried: resending the
    same request gets the same answer."""

    code = "provider_rejected"

    def __init__(self, message: str, *, status: int, body: str = "") -> None:
        super().__init__(message, status=status)
        self.body = body


class ProviderUnavailable(ProviderError):
    """Every attempt failed with something retryable (429, 5xx, connection error, timeout).
    The cause is chained; `attempts` says how many were made."""

    code = "provider_unavailable"

    def __init__(self, message: str, *, status: int | None, attempts: int) -> None:
        super().__init__(message, status=status)
        self.attempts = attempts


class ProviderResponseInvalid(ProviderError):
    """A success status whose body is not a chat completion. Not retried: it is a protocol
    mismatch, not a transient fault."""

    code = "provider_bad_response"


class RetryableStatus(Exception):
    """A 429 or 5xx answer, raised inside the retry loop so the policy can see it."""

    def __init__(self, status: int, retry_after: float | None, body: str) -> None:
        super().__init__(f"provider answered {status}: {body[:_BODY_EXCERPT]}")
        self.status = status
        self.retry_after = retry_after
        self.body = body


# -- retry policy (pure) --------------------------------------------------------------------------


_CLIENT_DEFAULTS = ClientConfig()


@dataclass(frozen=True, slots=True)
class ProviderRetry:
    """The client's retry policy (docs/client.md): full jitter, base 1 s, cap 300 s, 5 attempts; the
    defaults are `ClientConfig`'s, so the two cannot drift."""

    base_seconds: float = _CLIENT_DEFAULTS.retry_base_seconds
    cap_seconds: float = _CLIENT_DEFAULTS.retry_cap_seconds
    attempts: int = _CLIENT_DEFAULTS.retry_attempts

    @classmethod
    def from_client_config(cls, config: ClientConfig) -> ProviderRetry:
        """The same retry budget as the SDK's own requests under `config`."""
        return cls(config.retry_base_seconds, config.retry_cap_seconds, config.retry_attempts)

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1: {self.attempts!r}")
        if not (self.base_seconds >= 0 and self.cap_seconds >= 0):
            raise ValueError("base_seconds and cap_seconds must be >= 0")


def is_retryable(exc: BaseException) -> bool:
    """Whether resending the same request may succeed: 429/5xx, connection errors, timeouts,
    a body cut short. Everything else (4xx, a malformed success) fails the same way again."""
    return isinstance(
        exc,
        RetryableStatus | aiohttp.ClientConnectionError | aiohttp.ClientPayloadError | TimeoutError,
    )


def retry_delay(
    policy: ProviderRetry, failed_attempts: int, uniform: float, retry_after: float | None = None
) -> float:
    """Seconds to wait after `failed_attempts` failures (1-based), given `uniform` in [0, 1).

    Full jitter: uniform * min(cap, base * 2^(n-1)). A server's Retry-After is a floor (it knows
    when it will take us back) but is clamped to the cap, so one header cannot park a worker
    longer than the policy allows.
    """
    ceiling = min(policy.cap_seconds, policy.base_seconds * 2.0 ** (failed_attempts - 1))
    delay = uniform * ceiling
    if retry_after is not None:
        delay = max(delay, min(retry_after, policy.cap_seconds))
    return delay


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Retry-After as seconds from `now`: either delay-seconds or an HTTP-date (RFC 9110 §10.2.3).
    None when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:  # RFC 9110 dates are GMT
            return None
        seconds = when.timestamp() - now
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


# -- HTTP provider --------------------------------------------------------------------------------


class OpenAICompatibleProvider:
    """`Provider` for OpenAI-compatible chat endpoints (OpenAI, vLLM, llama.cpp, Ollama…).

    `base_url` includes the API version, as in the OpenAI SDK: ``http://127.0.0.1:8000/v1``;
    requests go to ``{base_url}/chat/completions``. Pass a `session` to share a connection pool
    (it stays yours to close); otherwise the provider opens one on first use and `aclose()` (or
    ``async with``) closes it. `sleep` and `uniform` are injectable so tests do not wait.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        model: str,
        timeout: float = DEFAULT_PROVIDER_TIMEOUT_SECONDS,
        session: aiohttp.ClientSession | None = None,
        retry: ProviderRetry | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        uniform: Callable[[], float] = random.random,
        clock: Callable[[], float] = time.time,
        max_response_bytes: int | None = None,
    ) -> None:
        # `max_response_bytes`: the largest body (answer or error page, counted decompressed)
        # read from the provider; None reads it whole. No default cap: no documented
        # limit applies, so a deployment facing an untrusted endpoint sets one.
        if max_response_bytes is not None and max_response_bytes < 1:
            raise ValueError(f"max_response_bytes must be >= 1: {max_response_bytes!r}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.retry = retry if retry is not None else ProviderRetry()
        self._api_key = api_key
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session = session
        self._owns_session = session is None
        self._sleep = sleep
        self._uniform = uniform
        self._clock = clock
        self._max_response_bytes = max_response_bytes

    async def complete(
        self, prompt: str, *, model: str | None = None, **params: Any
    ) -> ProviderResult:
        """POST one chat completion with `prompt` as the user message; retry per `self.retry`.

        Raises `ProviderRejected` (4xx but 429, first time), `ProviderUnavailable` (retries
        exhausted) or `ProviderResponseInvalid` (a 2xx that is not a completion).
        """
        body: dict[str, Any] = {
            "model": model or self.model,
            "messages": [{"role": "user", "content": prompt}],
            **params,
        }
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.retry.attempts),
            wait=self._wait,
            retry=retry_if_exception(is_retryable),
            sleep=self._sleep,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._post(body)
        except (RetryableStatus, aiohttp.ClientError, TimeoutError) as exc:
            if not is_retryable(exc):  # e.g. an invalid URL: the same on every attempt
                # Not `{exc!r}`: a ClientResponseError's repr (TooManyRedirects on a redirect
                # loop) carries its request's headers, the Authorization header included.
                raise ProviderError(
                    self._redact(f"provider request failed: {type(exc).__name__}: {exc}")
                ) from exc
            status = exc.status if isinstance(exc, RetryableStatus) else None
            raise ProviderUnavailable(
                self._redact(
                    f"provider still failing after {self.retry.attempts} attempts: "
                    f"{type(exc).__name__}: {exc}"
                ),
                status=status,
                attempts=self.retry.attempts,
            ) from exc
        raise AssertionError("tenacity returned without a result")  # pragma: no cover

    async def aclose(self) -> None:
        """Close the session if this provider opened it."""
        if self._owns_session and self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def __aenter__(self) -> OpenAICompatibleProvider:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        retry_after = exc.retry_after if isinstance(exc, RetryableStatus) else None
        return retry_delay(self.retry, state.attempt_number, self._uniform(), retry_after)

    def _redact(self, text: str) -> str:
        """`text` without the API key: error messages end up in logs and in the queue's stored
        error payloads, and a provider may echo the key it refused ("invalid key sk-...")."""
        if self._api_key:
            text = text.replace(self._api_key, _REDACTED)
        return text

    async def _error_body(self, resp: aiohttp.ClientResponse) -> str:
        """An error answer's body, bounded and decoded leniently: a non-UTF-8 or endless 5xx
        page must still become a typed `ProviderError`, not a `UnicodeDecodeError` (which is not
        retryable and escapes the provider's error types) or a memory spike."""
        raw = await _read_capped(resp, self._max_response_bytes)
        try:
            text = raw.decode(resp.charset or "utf-8", errors="replace")
        except LookupError:  # a charset Python does not know
            text = raw.decode("utf-8", errors="replace")
        return self._redact(text)

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    async def _post(self, body: dict[str, Any]) -> ProviderResult:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        async with self._session.post(
            self.url, json=body, headers=self._headers(), timeout=self._timeout
        ) as resp:
            if resp.status == 429 or resp.status >= 500:
                retry_after = parse_retry_after(resp.headers.get("Retry-After"), self._clock())
                raise RetryableStatus(resp.status, retry_after, await self._error_body(resp))
            if resp.status >= 400:
                text = await self._error_body(resp)
                raise ProviderRejected(
                    f"provider refused the request ({resp.status}): {text[:_BODY_EXCERPT]}",
                    status=resp.status,
                    body=text,
                )
            raw = await _read_capped(resp, self._max_response_bytes)
            if self._max_response_bytes is not None and len(raw) > self._max_response_bytes:
                raise ProviderResponseInvalid(
                    f"provider answer larger than {self._max_response_bytes} bytes",
                    status=resp.status,
                )
        try:
            return _parse_completion(raw, resp.status)
        except ProviderResponseInvalid as exc:  # its excerpt of the body may echo the key
            redacted = ProviderResponseInvalid(self._redact(exc.message), status=exc.status)
            raise redacted from exc.__cause__


async def _read_capped(resp: aiohttp.ClientResponse, limit: int | None) -> bytes:
    """At most `limit + 1` bytes of the (decompressed) body: more than `limit` means too large,
    and the rest is never read (the connection is dropped, not drained). None: the whole body."""
    if limit is None:
        return await resp.read()
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(64 * 1024):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            break
    return b"".join(chunks)[: limit + 1]


def _parse_completion(raw: bytes, status: int) -> ProviderResult:
    try:
        data = json.loads(raw)
        content = data["choices"][0]["message"]["content"]
    # RecursionError: `json.loads` of deeply nested brackets ("[[[[…") exceeds the C decoder's
    # recursion limit; it is as malformed as any other non-completion.
    except (ValueError, KeyError, IndexError, TypeError, RecursionError) as exc:
        raise ProviderResponseInvalid(
            f"not a chat completion: {raw[:_BODY_EXCERPT]!r}", status=status
        ) from exc
    if not isinstance(content, str):
        raise ProviderResponseInvalid(
            f"completion content is not text: {content!r}"[:_BODY_EXCERPT], status=status
        )
    usage = data.get("usage")
    return ProviderResult(text=content, raw=data, usage=usage if isinstance(usage, dict) else {})


# -- counting fake --------------------------------------------------------------------------------


def fake_answer(prompt: str) -> str:
    """The answer `cv_workspace_client.testing.CountingFakeProvider` gives to `prompt` by
    default: stable across runs and processes, different for different prompts."""
    return "fake:" + hashlib.sha256(prompt.encode()).hexdigest()[:16]
