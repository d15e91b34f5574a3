"""The HTTP transport of the work-queue routes (docs/protocol.md, docs/queue.md): one request to
a queue route with the host's token, its answer read by the SDK's one interpreter
(`_answers.read_answer`: JSON decoded, or the problem+json turned back into the typed error:
`LeaseLostError` when a fenced verb is refused, `RequestCancelledError` when a heartbeat finds
its request cancelled), and the SDK's retry rule around it.

The requester's verbs (`_queue.requester`) and the claim holder's (`_queue.holder`) both go through
here. Each needs only a *host* (`QueueHost`): an object with `url`, `session` (an aiohttp
session) and `auth_headers()`.

Retries follow the one rule of the SDK (docs/client.md): only connection errors, timeouts, 5xx and
429 are retried, and only for calls that are safe to repeat — reads, enqueues that cannot fork
(deterministic ids or an Idempotency-Key) and the holder's fenced verbs (a retried `complete`
is answered with the finished row). A claim is not retried: a lost answer leaves a row leased to
nobody, which the lease re-drives. `retried` applies the rule to one call; `enqueue` runs its own
loop on `call` (it also waits out a key still in progress), and a claim calls `call` just once.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp

from cv_workspace_client._core.answers import ANY_SUCCESS, parse_retry_after, read_answer
from cv_workspace_client._io.auth import TokenRefresher, with_token
from cv_workspace_client._io.http import exchange
from cv_workspace_client._io.retry import backoff_for, is_retryable, log_retry, retrying
from cv_workspace_client.config import ClientConfig
from cv_workspace_client.errors import WorkspaceError, error_from_problem

__all__ = ["QueueHost", "call", "config_of", "queue_error", "retried", "ws_path"]


class QueueHost(Protocol):
    """What the queue calls need from their owner."""

    url: str

    @property
    def session(self) -> aiohttp.ClientSession: ...

    @property
    def token_refresher(self) -> TokenRefresher | None: ...

    def auth_headers(self) -> dict[str, str]: ...


def ws_path(workspace_id: str, *rest: str) -> str:
    tail = "".join("/" + quote(part, safe="") for part in rest)
    return f"/v1/workspaces/{quote(workspace_id, safe='')}{tail}"


def queue_error(
    status: int, problem: Mapping[str, Any] | None, retry_after: str | None
) -> WorkspaceError:
    """The typed error of a queue route's problem (`lease_lost` → `LeaseLostError`,
    `cancelled` → `RequestCancelledError`)."""
    return error_from_problem(status, problem, retry_after=parse_retry_after(retry_after))


async def call(
    host: QueueHost,
    method: str,
    path: str,
    *,
    body: Any = None,
    params: Sequence[tuple[str, str]] | None = None,
    headers: Mapping[str, str] | None = None,
    raw: bytes | None = None,
) -> tuple[int, Any, Mapping[str, str]]:
    """One request. 2xx → (status, decoded JSON or None, headers); otherwise the typed error.
    `body` goes as JSON; `raw`, bytes of JSON already encoded, goes as it is. Refused for its
    token, it goes once more with a fresh one if the host gets one."""
    return await with_token(
        host,
        lambda auth: _call_once(
            host, method, path, auth, body=body, params=params, headers=headers, raw=raw
        ),
    )


async def _call_once(
    host: QueueHost,
    method: str,
    path: str,
    auth: Mapping[str, str],
    *,
    body: Any,
    params: Sequence[tuple[str, str]] | None,
    headers: Mapping[str, str] | None,
    raw: bytes | None = None,
) -> tuple[int, Any, Mapping[str, str]]:
    data = raw if body is None else json.dumps(body, separators=(",", ":")).encode()
    status, raw, answer_headers = await exchange(
        host.session,
        method,
        host.url + path,
        headers={**auth, **(headers or {})},
        data=data,
        params=params,
    )
    return status, read_answer(status, raw, answer_headers, accept=ANY_SUCCESS), answer_headers


def config_of(host: object) -> ClientConfig:
    config = getattr(host, "config", None)
    return config if isinstance(config, ClientConfig) else ClientConfig()


async def retried(
    host: QueueHost, method: str, path: str, *, retry_body: Any = None, **kwargs: Any
) -> Any:
    """`call` under the SDK's retry rule; returns the decoded body. A `retry_body` is what the
    retries send instead of `body` (a report whose first attempt carried a `claim_next`: a
    claim is never retried, the report is)."""
    try:  # the first attempt without tenacity: it is the worker's hot path (claim, complete)
        _, answer, _ = await call(host, method, path, **kwargs)
        return answer
    except WorkspaceError as exc:
        if not is_retryable(exc):
            raise
        first_error = exc
    if retry_body is not None:
        kwargs["body"] = retry_body
    config = config_of(host)
    if config.retry_attempts <= 1:
        raise first_error
    delay = backoff_for(config)(1)
    if first_error.retry_after is not None:
        delay = min(max(first_error.retry_after, 0.0), config.retry_cap_seconds)
    log_retry(first_error, 1, config.retry_attempts, delay)
    await config.sleep(delay)
    retry_config = dataclasses.replace(config, retry_attempts=config.retry_attempts - 1)
    async for attempt in retrying(retry_config):
        with attempt:
            _, answer, _ = await call(host, method, path, **kwargs)
    return answer
