"""Fresh tokens when the server refuses one: the app's `token_provider`, asked by the SDK.

Tokens expire (`cv-server token --ttl`) or are revoked. Without a provider the app watches
`sync_status.refused` and calls `WorkspaceClient.set_token()`; with one, the SDK asks it itself,
the way apps expect of sync SDKs (a `getAuth` / `fetchCredentials` callback): a request the
server refused with 401 or 403 gets a new token from the provider and goes again, once, and a
websocket refused at its handshake (or closed at its token's expiry, 4001) connects again with it.

The rule that keeps a provider from being asked in a loop (`RefreshPolicy`, pure): a token the
provider gave that is refused in turn (a workspace the user lost access to: every fresh token is
refused too), or a provider that fails, counts as a failed refresh. The next refresh waits the
client's retry delay (full jitter, base 1 s, cap 300 s: docs/configuration.md), and after
`retry_attempts` failed refreshes in a row the provider is not asked again: the refusal stands (ops
wait in the outbox, `sync_status.refused` names the workspace) until the app calls `set_token()`,
`retry_pending()` or `wait_synced()`. A refreshed token that is accepted resets the count, so an
app whose tokens expire every hour refreshes every hour, for ever.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

from cv_workspace_client.errors import AuthError, ForbiddenError

__all__ = [
    "RefreshPolicy",
    "TokenHost",
    "TokenProvider",
    "TokenRefresher",
    "bearer_of",
    "with_token",
]

T = TypeVar("T")

logger = logging.getLogger("cv_workspace_client")

#: The app's source of fresh tokens: an async callable returning the bearer token to use now.
TokenProvider = Callable[[], Awaitable[str]]


def bearer_of(headers: Mapping[str, str]) -> str | None:
    """The token a request carried (its `Authorization: Bearer` header), None if none."""
    value = headers.get("Authorization")
    if value is None or not value.startswith("Bearer "):
        return None
    return value[len("Bearer ") :]


@dataclass
class RefreshPolicy:
    """When to ask the provider again (no I/O: the shell sleeps and asks).

    `failures` counts refreshes since the last one that worked: tokens the provider gave that
    were refused in turn, and provider calls that failed.
    """

    attempts: int
    backoff: Callable[[int], float]
    failures: int = 0

    def delay(self) -> float | None:
        """Seconds to wait before asking the provider, or None: do not ask, the refusal stands."""
        if self.failures >= self.attempts:
            return None
        return self.backoff(self.failures) if self.failures else 0.0

    def asked(self) -> None:
        """A refresh was made (or failed): it counts until a request succeeds with its token."""
        self.failures += 1

    def accepted(self) -> None:
        """A refreshed token was accepted: the next expiry refreshes at once again."""
        self.failures = 0


class TokenRefresher:
    """One refresh at a time, shared by every request and websocket refused meanwhile.

    Args:
        provider: the app's `token_provider`, or None (then only a token the app replaced while
            a request was out makes it go again).
        current: the token the client holds now.
        adopt: make a fresh token the client's (`WorkspaceClient` swaps it in, reconnects
            websockets that gave up, and resends the ops parked on the refusal).
        policy: the retry rule for refreshes.
        sleep: how to wait (the client's `config.sleep`, shrunk by tests).
        timeout: the most one provider call may take (the client's request timeout: asking for
            a token is a request like any other); past it the call counts as failed.
    """

    def __init__(
        self,
        provider: TokenProvider | None,
        *,
        current: Callable[[], str | None],
        adopt: Callable[[str], None],
        policy: RefreshPolicy,
        sleep: Callable[[float], Awaitable[None]],
        timeout: float | None = None,
    ) -> None:
        self.provider = provider
        self.timeout = timeout
        self.policy = policy
        #: What the provider last raised (or why its answer was unusable), for the app's logs.
        self.last_error: BaseException | None = None
        self._current = current
        self._adopt = adopt
        self._sleep = sleep
        self._running: asyncio.Future[bool] | None = None
        self._closed = False
        #: The tokens the provider gave since the last one accepted: a refusal of one of them is
        #: a failed refresh; a refusal of any other token (one the app set) is a plain expiry.
        self._given: set[str] = set()

    async def refreshed(self, refused: str | None) -> bool:
        """The server refused `refused`. True if another token is now the client's (go again,
        once, with it); False if the refusal stands."""
        if self._current() != refused:
            return True  # replaced while the request was out (`set_token`, another refresh)
        if self.provider is None or self._closed:
            # Closed: a refresh started now adopted its token into a client that had closed
            # (`RuntimeError` into the refused request's caller) and asked the provider for
            # nothing.
            return False
        if self._running is None:
            self._running = asyncio.ensure_future(self._refresh(refused))
            self._running.add_done_callback(self._finished)
        running = self._running
        try:
            # Shielded: one caller cancelled (an app's timeout) must not cancel the refresh the
            # others wait for.
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            if running.cancelled() and not _cancelling():
                # The refresh was abandoned (`close()`), not this caller: its refusal stands.
                # Raised on, the CancelledError ended an app's `get_state` that nobody had
                # cancelled (and a `TaskGroup` around it took it for its own cancellation).
                return False
            raise

    def accepted(self, token: str | None) -> None:
        """A request or a websocket succeeded with `token`."""
        if token is not None and token in self._given:
            self._given.clear()
            self.policy.accepted()

    def reset(self) -> None:
        """The app stepped in (`set_token`, `retry_pending`, `wait_synced`): a fresh count."""
        self._given.clear()
        self.policy.accepted()

    def close(self) -> None:
        """The client is closing: a refresh under way is abandoned (its callers are too), and
        no refusal from now on asks the provider."""
        self._closed = True
        if self._running is not None:
            self._running.cancel()

    def _finished(self, _: asyncio.Future[bool]) -> None:
        self._running = None

    async def ask(self) -> str | None:
        """One provider call, as `start()` and every refresh make it: the token, or None if the
        provider failed (`last_error` says how; the caller counts it). Bounded by `timeout`."""
        assert self.provider is not None
        try:
            # Bounded: a provider that never answers (its auth server silent) held every
            # refused request, and so `apply_op` and `wait_synced`, for ever.
            async with asyncio.timeout(self.timeout):
                token = await self.provider()
            if not isinstance(token, str) or not token:
                # Used as is, a non-str token (bytes) was sent as "Bearer b'...'" and never
                # matched the token the client held: every refusal looked like one of a token
                # replaced meanwhile, the provider was never asked again, and the websocket
                # reconnected in a hot loop (hundreds of handshakes a second).
                raise TypeError(f"token_provider returned {type(token).__name__}, not a token")
        except asyncio.CancelledError as exc:
            if _cancelling():
                raise  # this call was cancelled (`close()`, or `start()` by the app)
            # The provider's own cancellation (a task of its cancelled under it): a failure like
            # any other. Raised on, it ended the refused request's task without a word: its
            # batch stayed in flight, the lane and `wait_synced` hung for ever.
            self._failed(exc)
            return None
        except Exception as exc:
            # The provider's own failure (its auth server down): counted like a refused token,
            # so the next refusal waits before asking again; the op path keeps its ops.
            self._failed(exc)
            return None
        self.last_error = None
        return token

    def _failed(self, exc: BaseException) -> None:
        logger.warning("token_provider failed: %s: %s", type(exc).__name__, exc)
        self.last_error = exc

    async def _refresh(self, refused: str | None) -> bool:
        assert self.provider is not None
        if refused is not None and refused in self._given:
            self.policy.asked()  # the last refresh's token was refused too
        delay = self.policy.delay()
        if delay is None:
            logger.warning(
                "the server refused %d fresh tokens in a row; waiting for set_token()",
                self.policy.failures,
            )
            return False
        while True:
            if delay:
                await self._sleep(delay)
                if self._current() != refused:
                    return True  # the app set one meanwhile
            token = await self.ask()
            if self._current() != refused:
                # `set_token` while the provider was out: the app's token wins over one asked
                # for before it (adopted, the stale answer replaced the token the app had set).
                return True
            if token is not None:
                break
            # The provider failed (its auth server down for a moment): asked again here, with
            # the backoff, while the policy allows. Given up at the first failure, the refused
            # request stood: a worker stopped and every subscription of a websocket ended on
            # one blip of the auth server.
            self.policy.asked()
            delay = self.policy.delay()
            if delay is None:
                return False
        if token == refused:
            self.policy.asked()  # nothing fresher to offer: the refusal stands
            return False
        self._given.add(token)
        self._adopt(token)
        return True


def _cancelling() -> bool:
    """Whether the running task has been asked to stop (a cancellation of its own, not one
    raised by something it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class TokenHost(Protocol):
    """What `with_token` needs: the headers to send now, and the refresher (None: no refresh)."""

    @property
    def token_refresher(self) -> TokenRefresher | None: ...

    def auth_headers(self) -> dict[str, str]: ...


async def with_token(host: TokenHost, attempt: Callable[[dict[str, str]], Awaitable[T]]) -> T:
    """Run `attempt(headers)`; refused for its token (401 / 403) and given another one by the
    host's refresher, run it once more with that one. A refused request was not looked at by
    the server, so sending it again cannot apply anything twice."""
    sent = host.auth_headers()
    try:
        return await attempt(sent)
    except (AuthError, ForbiddenError):
        refresher = host.token_refresher
        if refresher is None or not await refresher.refreshed(bearer_of(sent)):
            raise
    fresh = host.auth_headers()
    result = await attempt(fresh)
    refresher.accepted(bearer_of(fresh))
    return result
