"""The worker channel's route (docs/protocol.md, "The worker channel"): the thin aiohttp shell
around `cv_server.channel`. One websocket per worker process: the server hands it the requests
it claims for the worker as its slots free up, and answers its heartbeats and reports.

Every report goes through the store verbs the HTTP routes use (`heartbeat`, `complete_many`,
`complete_then_claim`, `fail`, `fail_then_claim`, `claim_many`), fenced by its `claim_token` the
same way, and pays the same rate-limit bucket as the route it stands for (`queue`; an offer of
free slots pays `claim`, as a claim call would). Claims wait on the same wake-up as the long poll
`GET /v1/queue/pending` (`WorkSignals`), with its 2 s sweep for a lease that lapsed (a lapse
announces nothing); an idle channel writes no log line. A dropped channel loses nothing: what its
worker held re-drives after its lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Final

import orjson
from aiohttp import WSMsgType, web

from cv_server.auth import TokenClaims
from cv_server.channel import (
    ChannelRefusal,
    CompleteFrame,
    DrainFrame,
    FailFrame,
    Frame,
    FreeFrame,
    HeartbeatFrame,
    HelloFrame,
    Slots,
    parse_frame,
    parse_hello,
    split_message,
)
from cv_server.http.openapi import Doc, Param, documented
from cv_server.http.problems import Problem
from cv_server.http.security import (
    BEARER_SUBPROTOCOL_PREFIX,
    authenticated_token,
    missing_scope,
    seconds_left,
    signed_with,
)
from cv_server.http.socket import CLOSE_UNAUTHORIZED
from cv_server.http.socket_close import LingeringWebSocketResponse
from cv_server.http.storage_faults import storage_problem
from cv_server.hub import Connection
from cv_server.keys import (
    CONFIG,
    CONNECTIONS,
    METRICS,
    RATE_LIMITS,
    REVOKED_TOKENS,
    STATE,
    STORES,
    TOKEN_SECRET,
    WORK_SIGNALS,
)
from cv_server.queue import ClaimAsk, ProcessRequest, QueueError
from cv_server.ratelimit import RouteClass

__all__ = ["CHANNEL_PATH", "CHANNEL_SUBPROTOCOL", "routes"]

log = logging.getLogger(__name__)
routes = web.RouteTableDef()

CHANNEL_PATH: Final = "/v1/queue/channel"
#: The subprotocol of the channel, answered when offered.
CHANNEL_SUBPROTOCOL: Final = "cv-worker.v1"
#: The idle sweep: a lapsed lease announces nothing, so an idle claim looks again this often
#: (the idle ceiling of the long poll, docs/queue.md).
SWEEP_SECONDS: Final = 2.0


class _Channel:
    """One worker's channel: its slots, its claimer, and the answers to its frames."""

    def __init__(
        self,
        app: web.Application,
        conn: Connection,
        claims: TokenClaims,
        token: str,
        hello: HelloFrame,
    ) -> None:
        self.app = app
        self.conn = conn
        self.claims = claims
        self.token = token
        self.hello = hello
        self.queue = app[STORES].queue
        self.config = app[CONFIG]
        self.metrics = app[METRICS]
        self.workspaces = None if "*" in claims.workspaces else sorted(claims.workspaces)
        self.slots = Slots()
        self.slots.offer(hello.slots)
        #: Set while the claimer may have slots to fill (`free` > 0).
        self._wanted = asyncio.Event()
        #: Set while no claim of the claimer is in flight (a drain waits for it).
        self._settled = asyncio.Event()
        self._settled.set()
        self._claimer = asyncio.create_task(self._claim_loop())

    # -- sending -----------------------------------------------------------------------------------

    def send(self, frame: dict[str, Any]) -> None:
        self.metrics.channel_frames.labels("out", frame["type"]).inc()
        self.conn.send_json(frame)

    def refuse(self, refusal: ChannelRefusal) -> None:
        self.send(refusal.to_json())

    def _hand(self, rows: list[ProcessRequest]) -> list[dict[str, Any]]:
        self.metrics.channel_claimed.inc(len(rows))
        return [row.to_json(include_claim_token=True) for row in rows]

    def _ask(self, limit: int) -> ClaimAsk:
        return ClaimAsk(
            self.hello.worker_classes,
            self.hello.worker_id,
            self.config.lease_seconds,
            limit,
            self.workspaces,
        )

    # -- claiming ----------------------------------------------------------------------------------

    def _offered(self) -> None:
        if self.slots.free > 0:
            self._wanted.set()

    async def _claim_loop(self) -> None:
        """Claim for the free slots; when nothing is claimable, wait for the push of new work
        (or the sweep). Ends when the channel does (cancelled) or the server shuts down."""
        signals = self.app[WORK_SIGNALS]
        classes = frozenset(self.hello.worker_classes)
        scope = None if self.workspaces is None else frozenset(self.workspaces)
        self._offered()
        while not self.app[STATE].shutting_down:
            await self._wanted.wait()
            taken = self.slots.take()
            if taken == 0:
                self._wanted.clear()
                continue
            self._settled.clear()
            rows: list[ProcessRequest] = []
            try:
                ask = self._ask(taken)
                rows = await self.queue.claim_many(
                    ask.worker_classes,
                    ask.worker_id,
                    ask.lease,
                    None,
                    limit=taken,
                    workspace_ids=ask.workspace_ids,
                )
            except Exception as exc:
                if storage_problem(self.app, exc) is None:
                    log.exception("a channel claim failed for %s", self.hello.worker_id)
            finally:
                self.slots.settle(taken, len(rows))
                self._settled.set()
            if rows:
                self.send({"type": "claimed", "requests": self._hand(rows)})
                continue

            def pending_now() -> Any:
                return self.queue.has_claimable(
                    self.hello.worker_classes, None, workspace_ids=self.workspaces
                )

            await signals.wait(classes, scope, SWEEP_SECONDS, pending_now=pending_now)

    # -- frames ------------------------------------------------------------------------------------

    async def handle(self, text: str) -> None:
        """One message of the worker: its frames, in order."""
        try:
            frames = split_message(text)
        except ChannelRefusal as refusal:
            self.count_in("malformed")
            self.refuse(refusal)
            return
        for raw in frames:
            try:
                frame = parse_frame(raw)
            except ChannelRefusal as refusal:
                self.count_in("refused")
                self.refuse(refusal)
                continue
            self.count_in(type(frame).__name__.removesuffix("Frame").lower())
            await self.handle_frame(frame)

    def count_in(self, kind: str) -> None:
        self.metrics.channel_frames.labels("in", kind).inc()

    def _charge(self, route_class: RouteClass, frame_id: Any, **extra: Any) -> None:
        """Take a token of `route_class` from the worker's bucket, as the HTTP verb would."""
        limits = self.app[RATE_LIMITS]
        if not limits.enabled:
            return
        wait = limits.take(route_class, self.token)
        if wait > 0:
            self.metrics.count_rate_limited(route_class)
            raise ChannelRefusal(
                "rate_limited",
                f"too many {route_class} frames for this token; retry in {wait:.3f} s",
                frame_id,
                retry_after=round(wait, 3),
                route_class=route_class,
                **extra,
            )

    async def handle_frame(self, frame: Frame) -> None:
        frame_id = getattr(frame, "frame_id", None)
        offered = getattr(frame, "free", 0)
        try:
            if isinstance(frame, FreeFrame):
                self._charge("claim", None, slots=frame.slots)
                self._offer(frame.slots, None)
                self._offered()
            elif isinstance(frame, DrainFrame):
                self.slots.stop()
                await self._settled.wait()  # rows of a claim in flight go out first
                self.send({"type": "answer", "id": frame_id})
            else:
                self._charge("queue", frame_id)
                self._offer(offered, frame_id)
                try:
                    answer = await self._report(frame)
                except BaseException:
                    self.slots.withdraw(offered)  # a report refused whole offered nothing
                    raise
                self.send({"type": "answer", "id": frame_id, **answer})
                self._offered()
        except ChannelRefusal as refusal:
            self.refuse(refusal)
        except Exception as exc:
            problem = storage_problem(self.app, exc)
            if problem is None:
                log.exception("a channel frame failed for %s", self.hello.worker_id)
                problem = Problem(500, "internal", "the server could not handle this frame")
            self.refuse(ChannelRefusal(problem.code, problem.detail, frame_id, **problem.extra))

    def _offer(self, count: int, frame_id: Any) -> None:
        try:
            self.slots.offer(count)
        except ValueError as exc:
            raise ChannelRefusal("invalid_field", str(exc), frame_id) from None

    async def _report(self, frame: HeartbeatFrame | CompleteFrame | FailFrame) -> dict[str, Any]:
        """The store verb the frame stands for, and the members of its answer."""
        if isinstance(frame, HeartbeatFrame):
            await self._check_grant([frame.request_id], frame.frame_id)
            try:
                row = await self.queue.heartbeat(
                    frame.request_id, frame.claim_token, self.config.lease_seconds, now=None
                )
            except QueueError as exc:
                return {"error": _refused(exc)}
            return {"lease_expires_at": row.lease_expires_at}
        if isinstance(frame, CompleteFrame):
            return await self._complete(frame)
        await self._check_grant([frame.request_id], frame.frame_id)
        backoff = self.config.failure_backoff_seconds
        taken = self.slots.take() if not self.slots.claiming else 0
        claimed: list[ProcessRequest] = []
        try:
            if taken:
                (outcome,), claimed = await self.queue.fail_then_claim(
                    frame.request_id,
                    frame.claim_token,
                    frame.error,
                    backoff,
                    now=None,
                    claim_next=self._ask(taken),
                )
            else:
                try:
                    outcome = await self.queue.fail(
                        frame.request_id, frame.claim_token, frame.error, backoff, now=None
                    )
                except QueueError as exc:
                    outcome = exc
        finally:
            self.slots.settle(taken, len(claimed))
        answer: dict[str, Any] = (
            {"error": _refused(outcome)}
            if isinstance(outcome, QueueError)
            else {"status": outcome.status, "available_at": outcome.available_at}
        )
        if taken:
            answer["claimed"] = self._hand(claimed)
        return answer

    async def _complete(self, frame: CompleteFrame) -> dict[str, Any]:
        blobs = [c for c in frame.completions if c.blob_ref is not None]
        threshold = self.config.blob_threshold_bytes
        for index, completion in enumerate(frame.completions):
            if len(orjson.dumps(completion.result)) > threshold:
                raise ChannelRefusal(
                    "invalid_field",
                    f"completions[{index}]: large results are uploaded first (blob_ref)",
                    frame.frame_id,
                    item_index=index,
                )
        ids = [c.request_id for c in frame.completions]
        workspaces = await self._check_grant(ids, frame.frame_id, read=bool(blobs))
        for completion in blobs:
            workspace = workspaces.get(completion.request_id)
            assert completion.blob_ref is not None
            if workspace is not None and (
                await self.app[STORES].blobs.size(workspace, completion.blob_ref, _wall()) is None
            ):
                raise ChannelRefusal(
                    "invalid_field",
                    f"blob_ref {completion.blob_ref!r} names no blob (or it expired)",
                    frame.frame_id,
                )
        taken = self.slots.take() if not self.slots.claiming else 0
        claimed: list[ProcessRequest] = []
        try:
            if taken:
                outcomes, claimed = await self.queue.complete_then_claim(
                    frame.completions, now=None, claim_next=self._ask(taken)
                )
            else:
                outcomes = await self.queue.complete_many(frame.completions, now=None)
        finally:
            self.slots.settle(taken, len(claimed))
        results = [
            {"request_id": c.request_id, "error": _refused(outcome)}
            if isinstance(outcome, QueueError)
            else {"request_id": c.request_id, "status": outcome.status}
            for c, outcome in zip(frame.completions, outcomes, strict=True)
        ]
        answer: dict[str, Any] = {"results": results}
        if taken:
            answer["claimed"] = self._hand(claimed)
        return answer

    async def _check_grant(
        self, request_ids: list[str], frame_id: Any, *, read: bool = False
    ) -> dict[str, str]:
        """Refuse the frame (`forbidden_workspace`) if it names a request of a workspace the
        token does not grant; the workspace of each request found. A token of every workspace
        needs no read (unless `read`): the claim token fences the rest."""
        if self.workspaces is None and not read:
            return {}
        rows = await self.queue.get_many(request_ids)
        for row in rows:
            if not self.claims.allows(row.workspace_id):
                raise ChannelRefusal(
                    "forbidden_workspace",
                    f"the token does not grant {row.workspace_id!r}",
                    frame_id,
                )
        return {row.request_id: row.workspace_id for row in rows}

    async def close(self) -> None:
        self.slots.stop()
        self._claimer.cancel()
        await asyncio.gather(self._claimer, return_exceptions=True)


def _refused(exc: QueueError) -> dict[str, Any]:
    return {"code": exc.code, "message": exc.message}


def _wall() -> float:
    """The blob store's clock (this server's wall clock, as the HTTP verbs use it)."""
    return time.time()


@routes.get(CHANNEL_PATH)
@documented(
    Doc(
        "Workers: the worker channel, a websocket handing out claimed requests as slots free up"
        " and carrying heartbeats and reports as frames",
        {101: None},
        description=(
            'A websocket upgrade (docs/protocol.md, "The worker channel"). The token goes in'
            " the Authorization header, or as the subprotocol `cv-bearer.<token>` (with"
            f" `{CHANNEL_SUBPROTOCOL}`). The first frame is a `hello`."
        ),
        params=(
            Param(
                "Sec-WebSocket-Protocol",
                {"type": "string"},
                f"Subprotocols offered: `{CHANNEL_SUBPROTOCOL}` (answered when offered), and a"
                f" token as `{BEARER_SUBPROTOCOL_PREFIX}<token>` (never echoed)",
                where="header",
            ),
        ),
        answer_headers={101: ("Sec-WebSocket-Protocol",)},
        problems={400: ("bad_request",), 503: ("unavailable",)},
        tag="workers",
    )
)
async def worker_channel(request: web.Request) -> web.WebSocketResponse:
    app = request.app
    config = app[CONFIG]
    token, claims = authenticated_token(request, allow_subprotocol=True)
    if not claims.has_any_scope(frozenset({"work"})):
        raise missing_scope(frozenset({"work"}))
    if app[STATE].shutting_down:
        raise Problem(503, "unavailable", "the server is shutting down")
    ws = LingeringWebSocketResponse(
        protocols=(CHANNEL_SUBPROTOCOL,),
        max_msg_size=config.max_ws_frame_bytes,
        autoping=True,
        heartbeat=config.socket_heartbeat_seconds,
    )
    await ws.prepare(request)
    conn = Connection(ws, config.subscriber_queue_limit, config.max_ws_frame_bytes)
    app[CONNECTIONS].add(conn)
    channel: _Channel | None = None
    watches = _watch_token(app, conn, claims, token)
    try:
        async for msg in ws:
            if msg.type != WSMsgType.TEXT:
                conn.send_json(
                    ChannelRefusal("malformed_json", "frames must be JSON text").to_json()
                )
                continue
            try:
                if channel is None:
                    channel = _open(app, conn, claims, token, msg.data)
                else:
                    await channel.handle(msg.data)
            except Exception:
                # One message the server failed on must not end the channel.
                log.exception("a worker channel message failed")
                conn.send_json({"type": "error", "code": "internal", "message": "retry"})
            if conn.closing:
                break
    except Exception:
        log.exception("a worker channel failed")
        closing = conn.close(1011, b"server error; reconnect")
        if closing is not None:
            await closing
    finally:
        for unwatch in watches:
            unwatch()
        app[CONNECTIONS].discard(conn)
        try:
            if channel is not None:
                await channel.close()
        finally:
            await conn.aclose()
            await ws.lingered()
    return ws


def _open(
    app: web.Application, conn: Connection, claims: TokenClaims, token: str, text: str
) -> _Channel | None:
    """The channel its `hello` opens, or None (the hello refused with an error frame; the
    worker may send another)."""
    metrics = app[METRICS]
    try:
        (frame, *rest) = split_message(text)
        hello = parse_hello(frame)
        if rest:
            raise ChannelRefusal("invalid_field", "the hello comes alone, before other frames")
    except ChannelRefusal as refusal:
        metrics.channel_frames.labels("in", "refused").inc()
        conn.send_json(refusal.to_json())
        return None
    metrics.channel_frames.labels("in", "hello").inc()
    channel = _Channel(app, conn, claims, token, hello)
    channel.send({"type": "welcome", "lease_seconds": app[CONFIG].lease_seconds})
    return channel


def _watch_token(
    app: web.Application, conn: Connection, claims: TokenClaims, token: str
) -> list[Any]:
    """Close the channel (4001) when its token expires, is revoked or its secret rotated, as
    the workspace socket is closed (`cv_server.http.socket`); the unwatchers."""
    unwatchers: list[Any] = []
    expires_in = seconds_left(claims)
    if expires_in is not None:
        timer = asyncio.get_running_loop().call_later(
            max(0.0, expires_in), conn.close, CLOSE_UNAUTHORIZED, b"token expired"
        )
        unwatchers.append(timer.cancel)

    def on_new_secret(secret: bytes) -> None:
        if not signed_with(secret, token):
            conn.close(CLOSE_UNAUTHORIZED, b"token secret rotated")

    def on_revoked(token_id: str) -> None:
        if token_id == claims.token_id:
            conn.close(CLOSE_UNAUTHORIZED, b"token revoked")

    unwatchers.append(app[TOKEN_SECRET].watch(on_new_secret))
    on_new_secret(app[TOKEN_SECRET].value)
    unwatchers.append(app[REVOKED_TOKENS].watch(on_revoked))
    if claims.token_id is not None and claims.token_id in app[REVOKED_TOKENS]:
        on_revoked(claims.token_id)
    return unwatchers
