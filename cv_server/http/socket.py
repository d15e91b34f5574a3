"""The workspace websocket (docs/protocol.md): subscribe / unsubscribe / apply, acks and live ops.

A message either way is one JSON frame or a JSON array of frames, handled in order as if each had
come alone. The server sends arrays only to a client that connected with `?batch=1` (frames that
queued up while the connection was busy: the ops and acks of one group commit); it accepts them
from any client (the SDK packs the applies its tasks queued meanwhile).

Applies to one sub-doc from one connection commit in the order they arrived (the store's own
order when it commits appends in the order they were queued, as SQLite's one writer does; else
each waits for the previous one); applies to different sub-docs meet in the group commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, Final

import orjson
from aiohttp import WSMsgType, web

from cv_mutations import is_valid_sub_doc, is_valid_workspace_id
from cv_server.auth import TokenClaims
from cv_server.http.inputs import check_since, decode_json, latest_minted_at, parse_apply
from cv_server.http.openapi import Doc, Param, documented
from cv_server.http.problems import Problem
from cv_server.http.ratelimit import refusal
from cv_server.http.security import (
    BEARER_SUBPROTOCOL_PREFIX,
    SOCKET_SUBPROTOCOL,
    authenticate,
    bearer_token,
    check_sub_doc,
    missing_scope,
    seconds_left,
    signed_with,
)
from cv_server.http.socket_close import LingeringWebSocketResponse
from cv_server.http.storage_faults import storage_problem
from cv_server.hub import Connection, Subscription
from cv_server.keys import (
    CONFIG,
    CONNECTIONS,
    HUB,
    METRICS,
    RATE_LIMITS,
    REVOKED_TOKENS,
    STATE,
    STORES,
    TOKEN_SECRET,
)
from cv_server.oplog import LogEntry, Outcome
from cv_server.publish import commit_and_publish, conflict_of, publish

__all__ = ["CLOSE_FORBIDDEN", "CLOSE_UNAUTHORIZED", "FRAME_SCOPES", "FRAME_TYPES", "routes"]

log = logging.getLogger(__name__)
routes = web.RouteTableDef()

CLOSE_UNAUTHORIZED = 4001
CLOSE_FORBIDDEN = 4003

#: The `req` of a frame is echoed in its answer, verbatim, whatever its JSON type; what orjson
#: cannot write inside an answer frame (an integer past 64 bits, a value nested past 254 levels)
#: is refused before any work, with an `invalid_field` error that carries no `req`.
_REQ_PROBLEM: Final = (
    "req cannot be echoed in an answer: integers must fit in 64 bits and values be nested "
    "at most 254 levels"
)


def _check_req(req: Any) -> None:
    """Refuse a `req` no answer could carry. Checked before anything else of the frame: an
    apply whose `req` could not be encoded committed its ops, then its ack failed to encode
    and the client never learnt they were applied (tests/server/http/test_socket_frames.py)."""
    if (
        req is None
        or isinstance(req, bool | float)
        or (isinstance(req, int) and -(2**63) <= req < 2**64)
    ):
        return  # the common cases, without an encoding (a string may hold a lone surrogate)
    try:
        orjson.dumps({"req": req})  # the answer frame's own level included
    except orjson.JSONEncodeError:
        raise Problem(400, "invalid_field", _REQ_PROBLEM) from None


#: The frames a client may send, by their `type` member (docs/protocol.md).
FRAME_TYPES: Final = ("subscribe", "unsubscribe", "apply")
#: The scope each frame needs (docs/operating.md, "Tokens and scopes"); a frame refused for it
#: is answered with a `missing_scope` error frame and the socket stays. The handshake needs one
#: of them (`cv_server.http.routes.ROUTE_SCOPES`; tests/server/http/test_scopes.py holds the two
#: alike). Subscribe and apply are held to the token's sub-doc grant too (`forbidden_sub_doc`).
FRAME_SCOPES: Final = {"subscribe": "read", "unsubscribe": "read", "apply": "write"}
_EXPECTED: Final = "one of " + ", ".join(f'"{kind}"' for kind in FRAME_TYPES)
#: A JSON value's type, by the Python type `decode_json` reads it as.
_JSON_TYPES: Final = {bool: "a boolean", int: "a number", float: "a number", list: "an array"}


def _unknown_type(frame: dict[str, Any]) -> str:
    """Why a frame's kind is refused, naming the member that carries it (`type`) and the kinds
    there are, so a client that guessed the member's name (`kind`, `op`) learns both from one
    error (`tests/server/http/test_socket.py`). The value sent is quoted short: never the repr
    of a value nested 1,000 deep (a RecursionError) or a megabyte long."""
    if "type" not in frame:
        return f'a frame names its kind in its "type" member ({_EXPECTED}); this one has none'
    kind = frame["type"]
    if isinstance(kind, str):
        sent = json.dumps(kind[:64])
    elif kind is None:
        sent = "null"
    else:
        sent = _JSON_TYPES.get(type(kind), "an object")
    return f'unknown frame "type" {sent}: expected {_EXPECTED}'


class _Session:
    """One authenticated socket on one workspace."""

    def __init__(
        self,
        app: web.Application,
        conn: Connection,
        workspace_id: str,
        token: str,
        claims: TokenClaims,
    ) -> None:
        self.app = app
        #: What the handshake's token may do: each frame is held to it.
        self.claims = claims
        self.conn = conn
        self.workspace_id = workspace_id
        #: The bearer token of the handshake: its `ops` bucket pays for each apply frame.
        self.token = token
        self.config = app[CONFIG]
        self._tails: dict[str, asyncio.Future[Any]] = {}
        # Applies read but not answered yet. The socket stops reading while they could fill
        # half its queue (each ends as an ack in it, often all at once from one group commit;
        # the other half is catch-up's): nothing else bounded them, and a peer sending faster
        # than the disk commits piled them up in the server without end.
        self._in_flight = 0
        self._room = asyncio.Event()
        self._room.set()

    def error(self, code: str, message: str, req: Any = None, **extra: Any) -> None:
        frame: dict[str, Any] = {"type": "error", "code": code, "message": message, **extra}
        if req is not None:
            frame["req"] = req
        self.conn.send_json(frame)

    def handle(self, text: str) -> None:
        """One message: a frame, or (from a batching client) a JSON array of frames, handled in
        order as if each had come alone."""
        try:
            body = decode_json(text)
        except Problem as problem:
            self.error(problem.code, problem.detail)
            return
        if isinstance(body, list) and body:
            for frame in body:
                self.handle_frame(frame)
        else:
            self.handle_frame(body)

    def handle_frame(self, frame: Any) -> None:
        req: Any = None
        try:
            if not isinstance(frame, dict):
                raise Problem(400, "malformed_json", "a frame must be a JSON object")
            _check_req(frame.get("req"))
            req = frame.get("req")
            kind = frame.get("type")
            if kind not in FRAME_TYPES:
                # Before its other members: a frame of a type the server does not know is
                # refused for that (tests/server/http/test_socket.py).
                raise Problem(400, "unknown_message_type", _unknown_type(frame))
            sub_doc = frame.get("sub_doc")
            if not isinstance(sub_doc, str) or not is_valid_sub_doc(sub_doc):
                raise Problem(422, "invalid_id", "sub_doc must match [a-z0-9_.-]{1,64}")
            if FRAME_SCOPES[kind] not in self.claims.scopes:
                problem = missing_scope(frozenset({FRAME_SCOPES[kind]}))
                problem.extra["sub_doc"] = sub_doc  # fails that subscription alone
                raise problem
            if kind != "unsubscribe":
                check_sub_doc(self.claims, sub_doc)
            if kind == "subscribe":
                # Bounded above as well: a `since` past SQLite's INTEGER range failed the
                # catch-up read and closed the whole socket (1011), every subscription with it.
                # The error names the sub-doc, so a client can fail that subscription alone.
                try:
                    since = check_since(frame.get("since", 0))
                except Problem as problem:
                    problem.extra["sub_doc"] = sub_doc
                    raise
                self.subscribe(sub_doc, since)
            elif kind == "unsubscribe":
                old = self.conn.subscriptions.pop(sub_doc, None)
                if old is not None:
                    old.stop()
            elif kind == "apply":
                if "enqueue" in frame:
                    # Refused, never dropped: ops applied without the work they asked for would
                    # be the dual write `enqueue` exists to prevent.
                    raise Problem(
                        422,
                        "invalid_field",
                        '"enqueue" is taken by the HTTP apply only'
                        " (docs/queue.md#start-work-with-the-change-that-needs-it)",
                    )
                body = {k: v for k, v in frame.items() if k in ("ops", "atomic", "if_clock")}
                apply = parse_apply(
                    body, self.config.max_ops_per_request, latest_minted_at(self.config)
                )
                # An apply frame is an ops request sent another way: the same bucket pays for
                # it, and a refusal is an error frame naming the req (with `retry_after`) that
                # the client retries, as it retries a 429.
                limits = self.app[RATE_LIMITS]
                wait = limits.take("ops", self.token)
                if wait > 0:
                    self.app[METRICS].count_rate_limited("ops")
                    raise refusal("ops", wait)
                self.apply(sub_doc, req, apply.ops, apply.atomic, apply.if_clock)
            else:
                raise Problem(400, "unknown_message_type", _unknown_type(frame))
        except Problem as problem:
            self.error(problem.code, problem.detail, req, **problem.extra)

    def subscribe(self, sub_doc: str, since: int) -> None:
        cap = self.config.max_subscriptions_per_socket
        if sub_doc not in self.conn.subscriptions and len(self.conn.subscriptions) >= cap:
            # Each subscription holds a hub entry, a task and a queue: 50,000 on one socket
            # were all served (+200 MB). Refused alone, naming its sub-doc and `since`, so the
            # client fails that subscription and keeps the others (docs/limits.md).
            self.app[METRICS].count_subscription_refused()
            raise Problem(  # the status is unused: a websocket error frame carries none
                409,
                "too_many_subscriptions",
                f"this socket has {cap} subscriptions, the most the server allows; "
                "unsubscribe one first",
                sub_doc=sub_doc,
                since=since,
            )
        old = self.conn.subscriptions.pop(sub_doc, None)
        if old is not None:
            old.stop()
        sub = Subscription(
            self.app[HUB],
            self.conn,
            self.workspace_id,
            sub_doc,
            since,
            page=self.config.catchup_page,
            pending_limit=self.config.subscriber_queue_limit,
        )
        self.conn.subscriptions[sub_doc] = sub
        sub.start()

    def apply(
        self, sub_doc: str, req: Any, ops: Any, atomic: bool, if_clock: int | None = None
    ) -> None:
        self._in_flight += 1
        if self._in_flight >= self.conn.catch_up_page:
            self._room.clear()
        store = self.app[STORES].oplog
        if store.appends_in_order:
            # The store commits appends in the order they were queued (SQLite's one writer): no
            # task and no chaining; the publish and the answer run from the commit's callback.
            future = store.append_nowait(
                self.workspace_id, sub_doc, ops, atomic=atomic, if_clock=if_clock
            )
            self._tails[sub_doc] = future
            future.add_done_callback(lambda f: self._committed(sub_doc, req, f))
            return
        previous = self._tails.get(sub_doc)
        if previous is None:
            # Nothing of this sub-doc in flight from this socket: commit right away (the common
            # case, so no extra task or shield on the hot path).
            task = asyncio.create_task(
                commit_and_publish(self.app, self.workspace_id, sub_doc, ops, atomic, if_clock)
            )
        else:
            task = asyncio.create_task(self._after(previous, sub_doc, ops, atomic, if_clock))
        self._tails[sub_doc] = task
        # Nothing cancels these tasks: a commit that started finishes and is published even if
        # the socket closes meanwhile (the client resends and is answered from the dedupe record).
        task.add_done_callback(lambda t: self._answer(sub_doc, req, t))

    async def _after(
        self,
        previous: asyncio.Future[Any],
        sub_doc: str,
        ops: Any,
        atomic: bool,
        if_clock: int | None,
    ) -> list[Outcome]:
        """Applies to one sub-doc from one socket commit in the order they arrived."""
        with contextlib.suppress(BaseException):
            await asyncio.shield(previous)
        return await commit_and_publish(self.app, self.workspace_id, sub_doc, ops, atomic, if_clock)

    def _committed(
        self,
        sub_doc: str,
        req: Any,
        future: asyncio.Future[tuple[list[Outcome], list[LogEntry]]],
    ) -> None:
        if self._finished(sub_doc, req, future):
            outcomes, entries = future.result()
            publish(self.app, self.workspace_id, sub_doc, outcomes, entries)
            self._ack(req, outcomes)

    def _answer(self, sub_doc: str, req: Any, task: asyncio.Task[list[Outcome]]) -> None:
        if self._finished(sub_doc, req, task):  # commit_and_publish has published
            self._ack(req, task.result())

    def _finished(self, sub_doc: str, req: Any, future: asyncio.Future[Any]) -> bool:
        """Forget the finished apply; answer `internal` if it failed. True if it committed."""
        self._in_flight -= 1
        if self._in_flight < self.conn.catch_up_page:
            self._room.set()
        if self._tails.get(sub_doc) is future:
            del self._tails[sub_doc]
        error = None if future.cancelled() else future.exception()
        storage = None if error is None else storage_problem(self.app, error)
        if storage is not None:
            # Refused whole, nothing kept: the socket stays up, the client resends later
            # (tests/server/http/test_storage_faults_http.py).
            log.warning("apply refused on %s/%s: %s", self.workspace_id, sub_doc, storage.detail)
            self.error("storage_unavailable", storage.detail, req, **storage.extra)
            return False
        if future.cancelled() or error is not None:
            log.error("apply failed on %s/%s", self.workspace_id, sub_doc, exc_info=error)
            self.error("internal", "the ops were not committed; retry", req)
            return False
        return True

    def _ack(self, req: Any, outcomes: list[Outcome]) -> None:
        conflict = conflict_of(outcomes)
        if conflict is not None:
            # As HTTP's 409: nothing of the batch applied (docs/ops.md#conflicts).
            results = [o.to_json() for o in outcomes]
            self.error(conflict.code, conflict.message, req, clock=conflict.clock, results=results)
            return
        self.conn.send_json({"type": "ack", "req": req, "results": [o.to_json() for o in outcomes]})

    async def room(self) -> None:
        """Wait until fewer applies than half the queue limit are in flight (`_in_flight`)."""
        await self._room.wait()

    async def wait_applies(self) -> None:
        tails = list(self._tails.values())
        if tails:
            # asyncio.wait, not gather: the handler of a socket whose peer went away gets
            # cancelled, and gather passed that cancel on to the commits' own futures. The
            # writer still committed, but `_committed` then saw a cancelled future: no publish,
            # so live subscribers missed the op until a later commit exposed the gap, and an
            # "apply failed" for an op that was applied. `wait` never cancels what it waits for.
            await asyncio.wait(tails)


@routes.get("/v1/workspaces/{ws}/socket")
@documented(
    Doc(
        "The websocket: subscribe to sub-docs (catch-up, then live ops) and apply ops",
        {101: None},
        description=(
            "A websocket upgrade. A browser, which cannot set headers here, offers its token as"
            " the subprotocol `cv-bearer.<token>` (with `cv-workspace.v1`); a refused token or"
            " workspace closes the socket with 4001 / 4003 after the upgrade."
        ),
        params=(
            Param(
                "token",
                {"type": "string"},
                "Older clients only: a token never travels in a URL (docs/protocol.md)",
            ),
            Param("batch", {"type": "string", "enum": ["1"]}, "Frames batched in JSON arrays"),
            Param(
                "Sec-WebSocket-Protocol",
                {"type": "string"},
                f"Subprotocols offered: `{SOCKET_SUBPROTOCOL}` (answered when offered), and a"
                f" browser's token as `{BEARER_SUBPROTOCOL_PREFIX}<token>` (never echoed)",
                where="header",
            ),
        ),
        answer_headers={101: ("Sec-WebSocket-Protocol",)},
        problems={400: ("bad_request",), 503: ("unavailable",)},
        tag="op-log",
    )
)
async def socket(request: web.Request) -> web.WebSocketResponse:
    app = request.app
    config = app[CONFIG]
    workspace_id = request.match_info["ws"]
    ws = LingeringWebSocketResponse(
        # Chosen when the client offers it (a browser passing its token as `cv-bearer.<token>`
        # must, since a browser fails a handshake whose answer names none of its offers).
        protocols=(SOCKET_SUBPROTOCOL,),
        max_msg_size=config.max_ws_frame_bytes,
        autoping=True,
        heartbeat=config.socket_heartbeat_seconds,
    )
    close_code: int | None = None
    reason = b""
    expires_in: float | None = None
    try:
        claims = authenticate(request, allow_query=True, allow_subprotocol=True)
        expires_in = seconds_left(claims)
        if not is_valid_workspace_id(workspace_id) or not claims.allows(workspace_id):
            close_code, reason = CLOSE_FORBIDDEN, b"forbidden workspace"
        elif not claims.has_any_scope(frozenset(FRAME_SCOPES.values())):
            close_code, reason = CLOSE_FORBIDDEN, b"missing_scope: read or write"
    except Problem as problem:
        close_code, reason = CLOSE_UNAUTHORIZED, problem.detail.encode()[:120]
    if app[STATE].shutting_down:
        raise Problem(503, "unavailable", "the server is shutting down")
    await ws.prepare(request)
    if close_code is not None:
        await ws.close(code=close_code, message=reason)
        return ws

    # `?batch=1`: the client reads a JSON array of frames as those frames, in order.
    batch_bytes = config.max_ws_frame_bytes if request.query.get("batch") == "1" else 0
    metrics = app[METRICS]
    conn = Connection(
        ws,
        config.subscriber_queue_limit,
        batch_bytes,
        on_too_slow=metrics.count_too_slow,
        on_written=metrics.record_written,
    )
    token = bearer_token(request, allow_query=True, allow_subprotocol=True)
    assert token is not None  # `authenticate` took it
    session = _Session(app, conn, workspace_id, token, claims)
    app[CONNECTIONS].add(conn)
    expiry = None
    if expires_in is not None:
        # HTTP refuses a token from the second it expires; the socket was authorized once, at
        # its handshake, and kept subscribing and applying under an expired token for as long
        # as it stayed open. It is closed then, with the handshake's own 4001. A timer, so no
        # frame pays for the check.
        expiry = asyncio.get_running_loop().call_later(
            max(0.0, expires_in), conn.close, CLOSE_UNAUTHORIZED, b"token expired"
        )

    def on_new_secret(secret: bytes) -> None:
        # The secret was rotated (a leak, say): a socket authorized by a token of the old one
        # must not outlive it any more than HTTP accepts that token. Closed as an expired token
        # is, so the client asks its token provider for a new one.
        if not signed_with(secret, token):
            conn.close(CLOSE_UNAUTHORIZED, b"token secret rotated")

    unwatch = app[TOKEN_SECRET].watch(on_new_secret)
    on_new_secret(app[TOKEN_SECRET].value)  # one rotated during the handshake's awaits

    def on_revoked(token_id: str) -> None:
        # Revoked (docs/operating.md, "Revoking a token"): closed as an expired token is, as
        # soon as this server reads the revocation (tests/server/test_token_revocation.py).
        if token_id == claims.token_id:
            conn.close(CLOSE_UNAUTHORIZED, b"token revoked")

    unwatch_revoked = app[REVOKED_TOKENS].watch(on_revoked)
    if claims.token_id is not None and claims.token_id in app[REVOKED_TOKENS]:
        on_revoked(claims.token_id)  # revoked during the handshake's awaits
    try:
        try:
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    try:
                        session.handle(msg.data)
                    except Exception:
                        # One message the server failed on must not end the socket and every
                        # subscription on it; and never an HTTP answer on the upgraded stream.
                        log.exception("a websocket message failed on %s", workspace_id)
                        session.error("internal", "the server could not handle this message")
                elif msg.type == WSMsgType.BINARY:
                    session.error("malformed_json", "frames must be JSON text")
                if conn.closing:
                    break
                await session.room()  # paced by the commits: see `_Session._in_flight`
        except Exception:
            # Never out to the middleware: its HTTP answer would land inside the upgraded
            # stream. The socket ends as a websocket does on a server error.
            log.exception("the socket of %s failed", workspace_id)
            closing = conn.close(1011, b"server error; reconnect")
            if closing is not None:
                await closing
    finally:
        unwatch()
        unwatch_revoked()
        if expiry is not None:
            expiry.cancel()
        app[CONNECTIONS].discard(conn)
        # Acks may no longer reach the client, but the commits themselves finish: the client
        # resends and the server answers from the dedupe record.
        try:
            await session.wait_applies()
        finally:  # even if that wait is cancelled: else the subscriptions stay in the hub
            await conn.aclose()
            # After a refused frame: until the peer has stopped sending (see socket_close).
            await ws.lingered()
    return ws
