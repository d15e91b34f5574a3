"""One workspace's websocket (docs/protocol.md): pipelined `apply` frames matched to acks by `req`,
and the live feed of every subscription of the workspace, reconnecting by itself.

A thin shell: what to send and when to retry is the machine's business; what a subscription keeps
or drops is the tracker's. This module only moves frames and reports what happened:

- an ack (or an `error` frame with a `req`) → `owner.batch_answered` / `owner.batch_failed`;
- the connection drops → every batch still in flight on it fails as retryable (the server may
  have committed it: the machine resends it under the same op_ids and gets `duplicate: true`);
- a (re)connect → `owner.connection_opened` (lanes that gave up replay), and every subscribed
  sub-doc is resubscribed with `since` = what its subscriptions already hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
import orjson

from cv_workspace_client._core.liveness import Liveness, Verdict
from cv_workspace_client._core.machine import Send
from cv_workspace_client._core.reconnect import ReconnectPolicy, Streak
from cv_workspace_client._io.auth import TokenRefresher, bearer_of
from cv_workspace_client._io.frames import ping, release, utf8_len, write_frames
from cv_workspace_client.config import ClientConfig
from cv_workspace_client.errors import (
    AuthError,
    ConnectionFailedError,
    ForbiddenError,
    InvalidRequestError,
    ProtocolError,
    WorkspaceError,
    error_from_problem,
)
from cv_workspace_client.stream import parse_frame_op

if TYPE_CHECKING:
    from cv_workspace_client.stream import Subscription

__all__ = ["SocketOwner", "WorkspaceSocket"]

#: Close codes that end the socket for good (docs/protocol.md): the token will not get better by
#: retrying.
_FINAL_CLOSE = {4001: ("unauthorized", AuthError), 4003: ("forbidden_workspace", ForbiddenError)}
#: The server refused a frame as too large: the batches in flight get `body_too_large`, which makes
#: the machine halve a multi-op batch (and fail a lone op) instead of resending it as it was.
_CLOSE_FRAME_TOO_LARGE = 1009


class SocketOwner(Protocol):
    """What the socket needs from the client."""

    config: ClientConfig
    reconnect: ReconnectPolicy

    @property
    def session(self) -> aiohttp.ClientSession: ...

    def socket_url(self, workspace_id: str) -> str: ...

    def auth_headers(self) -> dict[str, str]: ...

    @property
    def token_refresher(self) -> TokenRefresher | None: ...

    def batch_answered(self, batch_id: int, results: Any) -> None: ...

    def batch_failed(self, batch_id: int, error: WorkspaceError) -> None: ...

    def connection_opened(self, workspace_id: str) -> None: ...

    def connection_lost(self, workspace_id: str) -> None: ...

    def holding(self) -> contextlib.AbstractContextManager[None]:
        """While held, answers only update the machine; its decisions are carried out (one
        outbox write, one round of resolves) when the outermost hold ends."""
        ...


class WorkspaceSocket:
    """The client's websocket to one workspace. Runs while the client is open."""

    def __init__(self, owner: SocketOwner, workspace_id: str) -> None:
        self.owner = owner
        self.workspace_id = workspace_id
        self.final_error: WorkspaceError | None = None
        #: Successful connects so far (the first one included).
        self.connections = 0
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._frames: asyncio.Queue[str] | None = None
        self._task: asyncio.Task[None] | None = None
        #: Batches sent and not answered: batch_id → deadline (loop time), in send order. One
        #: timer watches the oldest, instead of a timer per batch created and cancelled per op.
        self._in_flight: dict[int, float] = {}
        #: Bytes of each in-flight batch's `apply` frame: on a "frame too large" close, only the
        #: largest is the one the server refused (see `_serve`).
        self._frame_sizes: dict[int, int] = {}
        self._deadline_timer: asyncio.TimerHandle | None = None
        #: The subscriptions fed from this socket, by sub-doc. Held weakly: an app leaves a
        #: subscription with `break` and drops it without `aclose()` (`async for` never calls it),
        #: and a strong reference here kept it buffering frames, and the server streaming its
        #: sub-doc, for the client's whole life. A collected one is forgotten by `_forget`; a
        #: consumer parked on its subscription keeps it alive (`stream.py`).
        self._subs: dict[str, list[weakref.ref[Subscription]]] = {}
        #: The `since` of the last subscribe sent per sub-doc: what a refusal refers to.
        self._since_sent: dict[str, int] = {}
        self._closed = False
        self._opened = asyncio.Event()
        #: Set when the socket stops for good (auth refused, or closed): `wait_open` must not
        #: wait for a connection that will never come.
        self._stopped = asyncio.Event()
        self._closing: set[asyncio.Task[Any]] = set()
        #: The heartbeat's next tick on the open connection (`_tick`).
        self._heartbeat: asyncio.TimerHandle | None = None
        #: What the server sent on this connection that the protocol does not allow (see
        #: `_breach`); None while it keeps to it.
        self._broken: ProtocolError | None = None
        #: The auth headers of the last connect (a refusal of stale ones is not final: `_final`).
        self._headers: dict[str, str] = {}
        #: The server refused the token on the open connection (a 4001 / 4003 close, an auth
        #: error frame): `_run` asks for a fresh one before it gives up (`_final`).
        self._refusal: WorkspaceError | None = None

    @property
    def is_open(self) -> bool:
        return self._frames is not None

    async def wait_open(self) -> None:
        """Return once the socket is connected (tests and benchmarks use it). Raise the final
        error (`AuthError` / `ForbiddenError`) once the socket gave up, `RuntimeError` once closed.
        """
        # Waiting on `_opened` alone hung forever (`connect(ws)` without a timeout) once the
        # server had refused the token: `_run` has returned, nothing would ever set it again.
        if not self._stopped.is_set() and not self._opened.is_set():
            opened = asyncio.ensure_future(self._opened.wait())
            stopped = asyncio.ensure_future(self._stopped.wait())
            try:
                await asyncio.wait({opened, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                opened.cancel()
                stopped.cancel()
        if self._stopped.is_set():
            if self.final_error is not None:
                raise self.final_error
            raise RuntimeError("the websocket is closed")

    def ensure_running(self) -> None:
        if self._closed or self.final_error is not None:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"cv-socket-{self.workspace_id}"
            )

    # -- ops --------------------------------------------------------------------------------------

    def send_batch(self, send: Send) -> bool:
        """Queue an `apply` frame for `send`; False when the socket is not open (use HTTP)."""
        frames = self._frames
        if frames is None:
            return False
        atomic = "true" if send.atomic else "false"
        frame = (
            f'{{"type":"apply","req":{send.batch_id},"sub_doc":{json.dumps(send.sub_doc)},'
            f'"ops":{send.ops_json()},"atomic":{atomic}}}'
        )
        size = utf8_len(frame)
        if size > self.owner.config.max_batch_bytes:
            # A batch at the cap, or a single op over it (it travels alone). A frame's envelope is
            # longer than an HTTP body's, so an op that fits the server's body limit could overrun
            # its frame limit and be refused as final `body_too_large` (a replayed one then
            # dropped with nobody told): HTTP, where it fits if anywhere.
            return False
        frames.put_nowait(frame)
        self._frame_sizes[send.batch_id] = size
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.owner.config.request_timeout_seconds
        self._in_flight[send.batch_id] = deadline
        if self._deadline_timer is None:
            self._deadline_timer = loop.call_at(deadline, self._acks_overdue)
        return True

    def _acks_overdue(self) -> None:
        """The oldest batch's deadline came: fail every batch past its deadline (deadlines grow
        in send order, so they are at the front), then watch the next oldest."""
        self._deadline_timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        overdue: list[int] = []
        for batch_id, deadline in self._in_flight.items():
            if deadline > now:
                self._deadline_timer = loop.call_at(deadline, self._acks_overdue)
                break
            overdue.append(batch_id)
        if not overdue:
            return
        with self.owner.holding():
            for batch_id in overdue:
                del self._in_flight[batch_id]
                self._frame_sizes.pop(batch_id, None)
                self.owner.batch_failed(
                    batch_id, ConnectionFailedError("timeout", "no ack before the request timeout")
                )

    def _forget_in_flight(self) -> dict[int, float]:
        in_flight, self._in_flight = self._in_flight, {}
        self._frame_sizes = {}
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        return in_flight

    # -- subscriptions ----------------------------------------------------------------------------

    def add(self, sub: Subscription) -> None:
        subs = self._subs.setdefault(sub.sub_doc, [])
        subs.append(weakref.ref(sub, self._collected(sub.sub_doc)))
        # Live ones only: one collected whose `_forget` has not run yet (a reconnect between)
        # may have no subscribe on this connection, and the newcomer would never be fed live.
        if sum(1 for ref in subs if ref() is not None) > 1:
            # The server already streams this sub-doc to us, from wherever the first subscription
            # was: the newcomer catches up from the log, and its tracker drops the overlap.
            sub.mark_lagging()
        elif self._frames is not None:
            self._subscribe(sub.sub_doc)
        if self.final_error is not None:
            sub.fail(self.final_error)
        self.ensure_running()

    def remove(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.sub_doc)
        if not subs:
            return
        left = [ref for ref in subs if ref() is not sub]
        if len(left) == len(subs):
            return
        self._keep(sub.sub_doc, left)

    def _live(self, sub_doc: str) -> list[Subscription]:
        return [sub for ref in self._subs.get(sub_doc, ()) if (sub := ref()) is not None]

    def _collected(self, sub_doc: str) -> Callable[[weakref.ref[Subscription]], None]:
        loop = asyncio.get_running_loop()

        def collected(_: weakref.ref[Subscription]) -> None:
            # The collector may run in any thread (the outbox's syncer allocates too): the
            # registry is only ever changed on the loop.
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to tell
                loop.call_soon_threadsafe(self._forget, sub_doc)

        return collected

    def _forget(self, sub_doc: str) -> None:
        """Drop the collected subscriptions of `sub_doc`; unsubscribe once none is left."""
        subs = self._subs.get(sub_doc)
        if subs is not None:
            self._keep(sub_doc, [ref for ref in subs if ref() is not None])

    def _keep(self, sub_doc: str, left: list[weakref.ref[Subscription]]) -> None:
        if left:
            self._subs[sub_doc] = left
            return
        del self._subs[sub_doc]
        self._since_sent.pop(sub_doc, None)
        if self._frames is not None:
            self._frames.put_nowait(json.dumps({"type": "unsubscribe", "sub_doc": sub_doc}))

    # -- lifetime ---------------------------------------------------------------------------------

    def reauthorize(self) -> None:
        """The client has a new token: a socket that gave up on the old one's refusal connects
        again (with `owner.auth_headers()`, now the new token's); one that is open keeps its
        connection (the server checked the token at the handshake)."""
        if self.final_error is None or self._closed:
            return
        self.final_error = None
        self._stopped.clear()
        self.ensure_running()

    async def close(self, *, abort: bool = False) -> None:
        self._closed = True
        self._stopped.set()
        ws = self._ws
        if ws is not None and not abort:
            with contextlib.suppress(Exception):
                await ws.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if ws is not None:
            # An abort sends no close frame (a crash does not), but the connection is still
            # released rather than left to garbage collection.
            release(ws)
        self._forget_in_flight()

    async def _run(self) -> None:
        """Connect, serve, and connect again as `owner.reconnect` says (`_core/reconnect.py`)."""
        policy = self.owner.reconnect
        streak = Streak()
        wait = False  # the first connect, and one with a fresh token, go at once
        while not self._closed:
            if wait:
                await self.owner.config.sleep(policy.delay(streak))
                if self._closed:
                    return
            wait = True
            self._headers = self.owner.auth_headers()
            try:
                ws = await self.owner.session.ws_connect(
                    self.owner.socket_url(self.workspace_id),
                    headers=self._headers,
                    # Pings answered and pongs seen here (`_serve`): the heartbeat is `Liveness`.
                    autoping=False,
                )
            except aiohttp.WSServerHandshakeError as exc:
                if policy.is_final(exc.status):
                    if await self._final(error_from_problem(exc.status, None)):
                        return
                    wait = False  # a token replaced or refreshed meanwhile: the new one, at once
                    continue
                streak = policy.refused(streak)
                continue
            except (TimeoutError, aiohttp.ClientError, OSError):
                streak = policy.refused(streak)
                continue
            heard = await self._serve(ws)
            refusal, self._refusal = self._refusal, None
            if refusal is not None:
                if await self._final(refusal):
                    return
                wait = False  # with the fresh token, at once
                continue
            streak = policy.ended(
                streak,
                delivered=heard,
                close_code=ws.close_code,
                broke_protocol=self._broken is not None,
            )

    async def _serve(self, ws: aiohttp.ClientWebSocketResponse) -> bool:
        frames: asyncio.Queue[str] = asyncio.Queue()
        self._ws = ws
        self._frames = frames
        for sub_doc in self._subs:
            self._subscribe(sub_doc)
        self._broken = None
        self.connections += 1
        self._opened.set()
        writer = asyncio.get_running_loop().create_task(
            write_frames(ws, frames, self.owner.config.max_batch_bytes)
        )
        heard = False
        interval = self.owner.config.socket_heartbeat_seconds
        live = None if interval is None else Liveness(interval)
        if live is not None:
            self._heartbeat = asyncio.get_running_loop().call_later(
                live.interval, self._tick, ws, live
            )
        try:
            self.owner.connection_opened(self.workspace_id)
            async for message in ws:
                if live is not None:
                    live.heard()
                if message.type is aiohttp.WSMsgType.TEXT:
                    if not heard:
                        heard = True
                        # The server answered on this connection: it took the token (an
                        # upgrade alone does not say so: a refusal is a 4001 / 4003 close
                        # right after it).
                        refresher = self.owner.token_refresher
                        if refresher is not None:
                            refresher.accepted(bearer_of(self._headers))
                    self._dispatch(message.data)
                elif message.type is aiohttp.WSMsgType.PING:
                    await ws.pong(message.data)
                elif message.type is aiohttp.WSMsgType.ERROR:
                    # aiohttp refused a message (over `max_msg_size`, not UTF-8, a bad frame)
                    # and is closing the connection itself, with a code of its own (1009 for
                    # a message too large: not the server refusing one of ours).
                    self._breach(f"an unreadable message ({message.data})")
                elif message.type is aiohttp.WSMsgType.BINARY:
                    self._breach("a binary message")
                if self._broken is not None:
                    break
        finally:
            if self._heartbeat is not None:
                self._heartbeat.cancel()
                self._heartbeat = None
            self._ws = None
            self._frames = None
            self._opened.clear()
            self.owner.connection_lost(self.workspace_id)
            writer.cancel()
            sizes = self._frame_sizes
            in_flight = self._forget_in_flight()
            if not self._closed:
                lost: WorkspaceError = self._broken or ConnectionFailedError(
                    "connection_lost", "the websocket closed"
                )
                too_large: int | None = None
                if ws.close_code == _CLOSE_FRAME_TOO_LARGE and in_flight and not self._broken:
                    # The server refused one message, not every batch in flight: the others
                    # (other sub-docs' batches) may even have been committed, their acks lost
                    # with the connection. Only the largest frame gets the final
                    # `body_too_large`; the rest are resent like any cut batch.
                    too_large = max(in_flight, key=lambda b: sizes.get(b, 0))
                for batch_id in in_flight:
                    error = lost
                    if batch_id == too_large:
                        error = InvalidRequestError(
                            "body_too_large", "the server refused the frame"
                        )
                    self.owner.batch_failed(batch_id, error)
        if self._broken is not None:  # after the batches were failed: a close may take a while
            await ws.close(code=aiohttp.WSCloseCode.PROTOCOL_ERROR)
        release(ws)
        final = _FINAL_CLOSE.get(ws.close_code or 0)
        if final is not None and self._refusal is None:
            code, cls = final
            self._refusal = cls(code, "the server closed the websocket")
        return heard

    def _tick(self, ws: aiohttp.ClientWebSocketResponse, live: Liveness) -> None:
        """The heartbeat (see `Liveness`): probe a quiet server, drop a dead connection."""
        self._heartbeat = None
        if self._ws is not ws:
            return  # that connection is over
        verdict, delay = live.tick()
        if verdict is Verdict.DEAD:
            # Nothing, not even a pong: the connection died without closing. Closing its
            # transport ends `_serve`'s read, which reports it lost like a reset: batches in
            # flight resent under their op_ids, subscriptions resumed, a reconnect at once
            # (it carried frames).
            release(ws)
            return
        if verdict is Verdict.PING:
            task = asyncio.get_running_loop().create_task(ping(ws))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        self._heartbeat = asyncio.get_running_loop().call_later(delay, self._tick, ws, live)

    def _dispatch(self, text: str) -> None:
        try:
            frame = orjson.loads(text)
        except orjson.JSONDecodeError:
            self._breach("a message that is not JSON")
            return
        if isinstance(frame, dict):
            self._dispatch_frame(frame)
        elif isinstance(frame, list):  # several frames in one message (`?batch=1`), in order
            # The acks of one group commit: act on them together (one outbox delete for all).
            with self.owner.holding():
                for item in frame:
                    if isinstance(item, dict):
                        self._dispatch_frame(item)
                    else:
                        self._breach("a frame that is not a JSON object")
        else:
            self._breach("a message that is not a JSON object or array")

    def _breach(self, what: str) -> None:
        """The server sent `what`, which the protocol does not allow. Whatever it was meant to
        carry (an op, an ack) is lost, and nothing else would notice: ignored, it left a
        subscription short of an op the server had sent until a later one exposed the hole, and
        an op waiting out its whole ack deadline. So the connection is dropped once this message
        is handled: the batches in flight are resent under their op_ids, the subscriptions
        resume from what they hold, and the reconnect backs off."""
        if self._broken is None:
            self._broken = ProtocolError("protocol_error", f"the server sent {what}")

    def _dispatch_frame(self, frame: dict[str, Any]) -> None:
        kind = frame.get("type")
        if kind == "op" or kind == "synced" or kind == "snapshot":
            sub_doc = frame.get("sub_doc")
            refs = self._subs.get(sub_doc, ()) if isinstance(sub_doc, str) else ()
            if not refs:
                return
            clock = frame.get("clock")
            if not isinstance(clock, int) or isinstance(clock, bool):
                self._breach(f"a {kind} frame without a valid clock")
                return
            if kind == "op":
                parse_frame_op(frame)  # once, however many subscriptions share the frame
            for ref in refs:
                sub = ref()
                if sub is not None:  # collected, and `_forget` not run yet
                    sub.feed(frame)
        elif kind == "ack":
            req = frame.get("req")
            if isinstance(req, int) and self._in_flight.pop(req, None) is not None:
                self._frame_sizes.pop(req, None)
                self.owner.batch_answered(req, frame.get("results"))
        elif kind == "error":
            error = error_from_problem(None, frame)
            req = frame.get("req")
            if isinstance(req, int) and self._in_flight.pop(req, None) is not None:
                self._frame_sizes.pop(req, None)
                self.owner.batch_failed(req, error)
            elif isinstance(error, AuthError | ForbiddenError):
                if self._refusal is None:
                    self._refusal = error
                    if self._ws is not None:
                        self._close_soon(self._ws)
            elif isinstance(frame.get("sub_doc"), str) and not error.retryable:
                self._refused(frame["sub_doc"], error, frame.get("since"))
            elif req is None:
                # An error naming no request: the server could not read one of our messages
                # (its applies are lost with it) or failed a subscription for now. Which
                # batches it concerns is unknown; resending them all is harmless (op_ids).
                # A `req` no longer in flight is a late answer to a batch already resent.
                self._breach(f"the error {error.code!r} naming no request")

    def _subscribe(self, sub_doc: str) -> None:
        """Ask for `sub_doc`'s feed from what its subscriptions already hold (now if the socket
        is open; `_serve` calls this again on every connect)."""
        subs = self._live(sub_doc)
        if not subs:
            return  # every one was collected: `_forget` is on its way
        since = min(s.resume_since() for s in subs)
        self._since_sent[sub_doc] = since
        if self._frames is not None:
            self._frames.put_nowait(_subscribe_frame(sub_doc, since))

    def _refused(self, sub_doc: str, error: WorkspaceError, since: Any = None) -> None:
        """The server refused the last subscribe of `sub_doc` (a `since` past its head) and
        dropped its feed of it. Only the subscriptions at or past that `since` fail: failing every
        one of the sub-doc failed a subscription opened meanwhile from a valid clock with another's
        error. And the failed ones are forgotten here: left registered, they kept the sub-doc
        marked as fed, so a subscription opened after them (the app starting over from the head)
        was caught up once from the log and never fed live. Those left are subscribed again.

        A refusal naming another `since` than the last subscribe sent is of an earlier subscribe,
        superseded on the server by the later one (closed, then the sub-doc subscribed afresh):
        it failed the new subscription with the old one's error. Ignored."""
        sent = self._since_sent.get(sub_doc)
        if isinstance(since, int) and not isinstance(since, bool) and since != sent:
            return
        subs = self._live(sub_doc)
        self._subs.pop(sub_doc, None)
        refused = self._since_sent.pop(sub_doc, None)
        left = [s for s in subs if refused is not None and s.resume_since() < refused]
        for sub in subs:
            if sub not in left:
                sub.fail(error)
        if left:
            self._subs[sub_doc] = [weakref.ref(s, self._collected(sub_doc)) for s in left]
            self._subscribe(sub_doc)

    async def _final(self, error: WorkspaceError) -> bool:
        """The server refused the connection for good (`error`, a 4xx): True once the socket
        gave up — stop reconnecting; subscriptions raise; ops fall back to HTTP (which gets the
        same answer and parks them).

        False, connect again at once, if the client holds another token: one `set_token` put
        in since the connect (the server closes a socket at its token's expiry, 4001, and apps
        refresh before that: taken as final, the socket died and the subscriptions failed
        though the client held a valid token), or, for a refused token, one the app's
        `token_provider` gave (`_io/auth.py`)."""
        refresher = self.owner.token_refresher
        if self._closed:
            return True
        if isinstance(error, AuthError | ForbiddenError) and refresher is not None:
            if await refresher.refreshed(bearer_of(self._headers)):
                return False
        elif self._headers != self.owner.auth_headers():
            return False
        if self._closed:
            return True
        self.final_error = error
        self._stopped.set()
        self.owner.connection_lost(self.workspace_id)  # the client's status says "refused"
        for sub_doc in self._subs:
            for sub in self._live(sub_doc):
                sub.fail(error)
        ws = self._ws
        if ws is not None:
            self._close_soon(ws)
        return True

    def _close_soon(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        task = asyncio.get_running_loop().create_task(ws.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


def _subscribe_frame(sub_doc: str, since: int) -> str:
    return json.dumps({"type": "subscribe", "sub_doc": sub_doc, "since": since})
