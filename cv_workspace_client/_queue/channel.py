"""The worker channel, the worker's side (docs/protocol.md, "The worker channel"): one websocket
per worker process, `GET /v1/queue/channel`. The worker offers its free slots; the server claims
for them and hands the rows over (`on_claimed`); heartbeats and reports go as frames, each
answered under its `id`, fenced by the claim token as the HTTP verbs are.

`ChannelHost` is the queue host a worker hands its holder verbs (`_queue.holder`): each verb goes
over the channel while one is open and over HTTP otherwise, or when the channel drops before
the answer (`ChannelClosedError`): the fenced verbs are safe to repeat, and the report's claim is
never repeated (the HTTP retry goes without it). A dropped channel loses nothing: rows the server
claimed for it and could not hand over are leased to nobody and re-drive after their lease.

Slots are counted as the server counts them (`credit`): offered, minus rows handed over; a
report's `free` slots count from its answer on (a report refused whole offered none).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, Final

import aiohttp
import orjson

from cv_workspace_client._io.auth import TokenRefresher, with_token
from cv_workspace_client._queue.transport import QueueHost, config_of
from cv_workspace_client.config import ClientConfig
from cv_workspace_client.errors import (
    ConnectionFailedError,
    ProtocolError,
    RateLimitedError,
    ServerError,
    WorkspaceError,
    error_from_problem,
)
from cv_workspace_client.queue_models import Claim, CompletionOutcome, QueuedRequest

__all__ = [
    "CHANNEL_PATH",
    "ChannelClosedError",
    "ChannelHost",
    "ChannelUnsupportedError",
    "WorkerChannel",
]

logger = logging.getLogger("cv_workspace_client.worker")

CHANNEL_PATH: Final = "/v1/queue/channel"
CHANNEL_SUBPROTOCOL: Final = "cv-worker.v1"
#: The statuses an answer's refusal (`{"code", "message"}`) is read under, by code.
_REFUSAL_STATUS: Final = {"not_found": 404, "forbidden_workspace": 403}


class ChannelClosedError(ConnectionFailedError):
    """The channel dropped (or was never open) before the answer: send the verb over HTTP."""

    def __init__(self, message: str = "the worker channel closed") -> None:
        super().__init__("channel_closed", message)


class ChannelUnsupportedError(WorkspaceError):
    """The server has no worker channel (404 on the handshake): the worker uses HTTP."""

    def __init__(self) -> None:
        super().__init__("channel_unsupported", "the server has no worker channel")


def _claims(rows: Any) -> list[Claim]:
    try:
        return [Claim(str(row["claim_token"]), QueuedRequest.from_json(row)) for row in rows]
    except (KeyError, TypeError) as exc:
        raise ProtocolError("bad_answer", f"channel claim: {exc!r}") from None


def _refusal(error: Any) -> WorkspaceError:
    if not isinstance(error, dict):
        raise ProtocolError("bad_answer", f"channel refusal: {error!r}")
    return error_from_problem(_REFUSAL_STATUS.get(str(error.get("code")), 409), error)


class WorkerChannel:
    """One open channel. `connect` opens it; every verb raises `ChannelClosedError` once it
    closed (send that verb over HTTP); `close` ends it."""

    def __init__(
        self,
        ws: aiohttp.ClientWebSocketResponse,
        config: ClientConfig,
        on_claimed: Callable[[list[Claim]], None],
        on_refused_offer: Callable[[float], None],
        on_closed: Callable[[], None] | None = None,
    ) -> None:
        self._on_closed = on_closed
        self._ws = ws
        self._config = config
        self._on_claimed = on_claimed
        self._on_refused_offer = on_refused_offer
        self._answers: dict[Any, asyncio.Future[dict[str, Any]]] = {}
        self._next_id = 0
        #: Slots the server holds for this worker and has not filled (see the module docstring).
        self.credit = 0
        self.closed = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def connect(
        cls,
        host: QueueHost,
        worker_classes: Sequence[str],
        worker_id: str,
        *,
        on_claimed: Callable[[list[Claim]], None],
        on_refused_offer: Callable[[float], None],
        on_closed: Callable[[], None] | None = None,
    ) -> WorkerChannel:
        """Open the channel and say hello (no slot offered yet). Raises
        `ChannelUnsupportedError` on a 404, the typed error of another refused handshake, or
        `ConnectionFailedError`."""
        config = config_of(host)

        async def handshake(headers: dict[str, str]) -> aiohttp.ClientWebSocketResponse:
            try:
                return await host.session.ws_connect(
                    host.url + CHANNEL_PATH,
                    headers=headers,
                    protocols=(CHANNEL_SUBPROTOCOL,),
                    autoping=True,
                )
            except aiohttp.WSServerHandshakeError as exc:
                if exc.status == 404:
                    raise ChannelUnsupportedError() from None
                raise error_from_problem(exc.status, None) from None
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                raise ConnectionFailedError("connection_failed", repr(exc)) from None

        # Refused for its token, once more with a fresh one if the host's provider has one.
        ws = await with_token(host, handshake)
        hello = {"type": "hello", "worker_classes": list(worker_classes), "worker_id": worker_id}
        try:
            await ws.send_str(orjson.dumps(hello).decode())
            async with asyncio.timeout(config.request_timeout_seconds):
                message = await ws.receive()
            frame = orjson.loads(message.data) if message.type == aiohttp.WSMsgType.TEXT else None
        except (TimeoutError, aiohttp.ClientError, OSError, orjson.JSONDecodeError) as exc:
            await ws.close()
            raise ConnectionFailedError("connection_failed", repr(exc)) from None
        if not isinstance(frame, dict) or frame.get("type") != "welcome":
            await ws.close()
            if isinstance(frame, dict) and frame.get("type") == "error":
                raise error_from_problem(None, frame)
            raise ConnectionFailedError("connection_failed", "the channel was not welcomed")
        return cls(ws, config, on_claimed, on_refused_offer, on_closed)

    @property
    def open(self) -> bool:
        return not self.closed.is_set()

    # -- reading -----------------------------------------------------------------------------------

    async def _read(self) -> None:
        try:
            async for message in self._ws:
                if message.type != aiohttp.WSMsgType.TEXT:
                    continue
                body = orjson.loads(message.data)
                for frame in body if isinstance(body, list) else [body]:
                    self._frame(frame)
        except (aiohttp.ClientError, OSError, orjson.JSONDecodeError) as exc:
            logger.warning("worker channel failed: %r", exc)
        finally:
            self._closed()

    def _frame(self, frame: Any) -> None:
        kind = frame.get("type") if isinstance(frame, dict) else None
        if kind == "claimed":
            rows = _claims(frame.get("requests"))
            self.credit = max(0, self.credit - len(rows))
            self._on_claimed(rows)
            return
        future = self._answers.pop(frame.get("id"), None) if isinstance(frame, dict) else None
        if kind == "answer" and future is not None:
            if not future.done():
                future.set_result(frame)
        elif kind == "error" and future is not None:
            if not future.done():
                future.set_exception(error_from_problem(None, frame))
        elif kind == "error" and isinstance(frame.get("slots"), int):
            # An offer refused (rate limited): those slots were never the server's.
            self.credit = max(0, self.credit - frame["slots"])
            self._on_refused_offer(float(frame.get("retry_after") or 0.0))
        else:
            logger.warning("worker channel: unexpected frame %.200r", frame)

    def _closed(self) -> None:
        if not self.closed.is_set() and self._on_closed is not None:
            self._on_closed()
        self.closed.set()
        self.credit = 0
        for future in self._answers.values():
            if not future.done():
                future.set_exception(ChannelClosedError())
        self._answers.clear()

    # -- sending -----------------------------------------------------------------------------------

    async def _send(self, frame: dict[str, Any]) -> None:
        if self.closed.is_set():
            raise ChannelClosedError()
        try:
            await self._ws.send_str(orjson.dumps(frame).decode())
        except (aiohttp.ClientError, OSError, RuntimeError) as exc:
            raise ChannelClosedError(repr(exc)) from None

    def offer(self, slots: int) -> None:
        """Offer `slots` more free slots; the rows come to `on_claimed`."""
        if slots <= 0 or self.closed.is_set():
            return
        self.credit += slots
        task = asyncio.ensure_future(self._send({"type": "free", "slots": slots}))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _ask(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Send a request frame and return its answer; a refusal (an `error` frame) raises its
        typed error. Rate limited, it waits as told and goes again (the frame changed
        nothing); a server error raises `ChannelClosedError` so the verb goes over HTTP, whose
        retries handle it."""
        attempts = max(1, self._config.retry_attempts)
        for attempt in range(attempts):
            self._next_id += 1
            frame_id = self._next_id
            future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            self._answers[frame_id] = future
            try:
                await self._send({**frame, "id": frame_id})
                return await future
            except RateLimitedError as exc:
                if attempt + 1 >= attempts:
                    raise
                wait = exc.retry_after if exc.retry_after is not None else 1.0
                await self._config.sleep(min(wait, self._config.retry_cap_seconds))
            except ServerError as exc:
                raise ChannelClosedError(f"{exc.code}: {exc.message}") from None
            finally:
                self._answers.pop(frame_id, None)
        raise AssertionError("unreachable")

    async def heartbeat(self, request_id: str, claim_token: str) -> float:
        answer = await self._ask(
            {"type": "heartbeat", "request_id": request_id, "claim_token": claim_token}
        )
        if "error" in answer:
            raise _refusal(answer["error"])
        return float(answer["lease_expires_at"])

    def _settle(self, free: int, answer: dict[str, Any]) -> list[Claim]:
        claimed = _claims(answer.get("claimed") or [])
        self.credit = max(0, self.credit + free - len(claimed))
        return claimed

    async def complete_many(
        self, completions: Sequence[dict[str, Any]], *, free: int = 0
    ) -> tuple[list[CompletionOutcome], list[Claim]]:
        """Many completions in one commit (with `free` slots to claim for in it): one outcome
        each, in order, and the rows claimed with them."""
        frame: dict[str, Any] = {"type": "complete", "completions": list(completions)}
        if free:
            frame["free"] = free
        answer = await self._ask(frame)
        claimed = self._settle(free, answer)
        outcomes = []
        try:
            for item in answer["results"]:
                error = item.get("error")
                outcomes.append(
                    CompletionOutcome(item["request_id"], status=item["status"])
                    if error is None
                    else CompletionOutcome(item["request_id"], error=_refusal(error))
                )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ProtocolError("bad_answer", f"channel complete answer: {exc!r}") from None
        if len(outcomes) != len(completions):
            raise ProtocolError("bad_answer", "one outcome per completion expected")
        return outcomes, claimed

    async def fail(
        self, request_id: str, claim_token: str, error: Any, *, free: int = 0
    ) -> tuple[CompletionOutcome, float | None, list[Claim]]:
        """A failure report (with `free` slots to claim for in its commit)."""
        frame: dict[str, Any] = {
            "type": "fail",
            "request_id": request_id,
            "claim_token": claim_token,
            "error": error,
        }
        if free:
            frame["free"] = free
        answer = await self._ask(frame)
        claimed = self._settle(free, answer)
        if "error" in answer:
            return CompletionOutcome(request_id, error=_refusal(answer["error"])), None, claimed
        outcome = CompletionOutcome(request_id, status=str(answer.get("status")))
        return outcome, answer.get("available_at"), claimed

    async def drain(self) -> None:
        """No more rows: answered once the server sent every row it claimed for us."""
        await self._ask({"type": "drain"})
        self.credit = 0

    def abort(self) -> None:
        """Give the channel up at once (its pending verbs raise `ChannelClosedError`)."""
        self._closed()
        self._reader.cancel()
        task = asyncio.ensure_future(self._ws.close())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def close(self) -> None:
        with contextlib.suppress(aiohttp.ClientError, OSError, RuntimeError):
            await self._ws.close()
        await asyncio.gather(self._reader, return_exceptions=True)
        self._closed()


class ChannelHost:
    """A queue host (`QueueHost`) whose holder verbs go over `channel` while it is open."""

    def __init__(self, client: QueueHost) -> None:
        self.client = client
        self.url = client.url
        self.config = config_of(client)
        self.channel: WorkerChannel | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        return self.client.session

    @property
    def token_refresher(self) -> TokenRefresher | None:
        return self.client.token_refresher

    def auth_headers(self) -> dict[str, str]:
        return self.client.auth_headers()

    def drop_channel(self) -> None:
        """The open channel went silent (a heartbeat unanswered): close it, so the next verb
        goes out over HTTP or a fresh channel, as a silent HTTP connection is replaced."""
        channel = self.open_channel()
        if channel is not None:
            channel.abort()

    def open_channel(self) -> WorkerChannel | None:
        channel = self.channel
        return channel if channel is not None and channel.open else None
