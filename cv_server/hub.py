"""Broadcast of committed ops to websocket subscribers (docs/protocol.md): the asyncio shell around
`fanout.Cursor`.

Every connection has one writer task draining a bounded queue of frames, so a slow subscriber only
ever slows itself: when its queue passes `subscriber_queue_limit` it is closed with 4008 and
resumes by catch-up when it reconnects. Catch-up itself never fills that queue: it reads the next
page of the log only once the queue is back to half the limit. Each committed op is encoded once,
whatever the number of subscribers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any, Final

import orjson
from aiohttp import web

from cv_server.fanout import Cursor, Frame
from cv_server.oplog import LogEntry, OpLogStore

__all__ = ["CLOSE_TOO_SLOW", "Connection", "Hub", "Subscription", "encode_entry"]

log = logging.getLogger(__name__)

#: Close code for a subscriber that fell too far behind; it reconnects and catches up.
CLOSE_TOO_SLOW: Final = 4008

#: Commit stamps kept for ops read back from the log (`Hub.stamped`). The log read they serve
#: follows the publish within a notification's grace (tens of milliseconds): 10,000 ops covers
#: that at many times the peak commit rate, in about a megabyte.
_RECENT_STAMPS: Final = 10_000


def encode_entry(sub_doc: str, entry: LogEntry) -> Frame:
    body = {"type": "op", "sub_doc": sub_doc, "clock": entry.clock, "op_id": entry.op_id}
    # The commit time, live or caught up alike (docs/protocol.md): an additive member, which old
    # clients ignore.
    if entry.committed_at is not None:
        body["committed_at"] = entry.committed_at
    body["op"] = entry.op
    try:
        text = orjson.dumps(body).decode()
    except orjson.JSONEncodeError:
        # An op logged before inputs refused ops nested past orjson's write limit: the standard
        # library still encodes it. Raising here would fail every catch-up over that clock (close
        # 1011 on each reconnect), so one such op would cut its sub-doc off from subscribers.
        text = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    return Frame(entry.clock, text)


class Connection:
    """The sending half of one websocket: a bounded frame queue and the task that drains it.

    With `batch_bytes` (the client opted in with `?batch=1`), frames that queued up while the
    writer was busy leave as one websocket message, a JSON array of them, up to that many bytes:
    the ops and acks of one group commit reach a connection in one write and one read instead of
    one per frame (on both ends, the per-message cost is most of what a frame costs).
    """

    def __init__(
        self,
        ws: web.WebSocketResponse,
        limit: int,
        batch_bytes: int = 0,
        on_too_slow: Callable[[], None] | None = None,
        on_written: Callable[[float], None] | None = None,
    ) -> None:
        self.ws = ws
        self.limit = limit
        self.batch_bytes = batch_bytes
        #: Called once when this connection is cut off as too slow (`/metrics` counts them).
        self._on_too_slow = on_too_slow
        self._queue: deque[str] = deque()
        #: Called with the commit stamp of each live op frame once it is written to the socket
        #: (`cv_broadcast_lag_seconds`). Stamps ride beside the queue, keyed by the frame's
        #: number: `_queued` counts frames ever queued, `_written` frames ever written.
        self._on_written = on_written
        self._stamps: deque[tuple[int, float]] = deque()
        self._queued = 0
        self._written = 0
        self._ready = asyncio.Event()
        # Set when the queue is at or below half the limit: catch-up waits on it (`room`).
        self._room = asyncio.Event()
        self._room.set()
        self._closing = False
        self._writer = asyncio.create_task(self._drain())
        self.subscriptions: dict[str, Subscription] = {}

    def send(self, text: str, stamp: float | None = None) -> bool:
        """Queue a frame (`stamp`: the `perf_counter()` of its commit, for a live op frame).
        False (and the connection closes with 4008) when over the limit."""
        if self._closing:
            return False
        if len(self._queue) >= self.limit:
            self.too_slow()
            return False
        self._queue.append(text)
        self._queued += 1
        if stamp is not None and self._on_written is not None:
            self._stamps.append((self._queued, stamp))
        self._ready.set()
        return True

    def send_json(self, body: dict[str, object]) -> bool:
        return self.send(orjson.dumps(body).decode())

    def too_slow(self) -> None:
        closing = self.close(CLOSE_TOO_SLOW, b"subscriber too far behind; reconnect and catch up")
        if closing is not None and self._on_too_slow is not None:
            self._on_too_slow()

    def close(self, code: int, message: bytes = b"") -> asyncio.Task[bool] | None:
        """Start closing with `code`; returns the closing task (None if already closing)."""
        if self._closing:
            return None
        self._closing = True
        self._queue.clear()
        self._stamps.clear()
        self._room.set()
        for subscription in list(self.subscriptions.values()):
            subscription.stop()
        self._writer.cancel()
        task = asyncio.create_task(self.ws.close(code=code, message=message))
        _background.add(task)
        task.add_done_callback(_background.discard)
        return task

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def catch_up_page(self) -> int:
        """Most frames one catch-up read may add: what fits on top of a half-full queue."""
        return max(1, self.limit - self.limit // 2)

    async def room(self) -> None:
        """Wait until the queue is at most half full (or the connection is closing).

        Catch-up awaits this before each log read: the log is its buffer, so it sends no faster
        than the peer reads. Pushing pages regardless filled the queue past the limit whenever
        the peer read slower than the disk, and a healthy subscriber resuming from far behind was
        closed with 4008 at every reconnect.
        """
        while not self._closing and len(self._queue) > self.limit // 2:
            self._room.clear()
            await self._room.wait()

    async def _drain(self) -> None:
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                queue = self._queue
                half = self.limit // 2
                while queue:
                    before = len(queue)
                    if before == 1 or not self.batch_bytes:
                        await self.ws.send_str(queue.popleft())
                    else:
                        await self.ws.send_str(self._pack(queue))
                    self._written += before - len(queue)
                    if self._stamps:
                        self._report_written()
                    if len(queue) <= half:
                        self._room.set()
        except (ConnectionResetError, RuntimeError):  # peer gone; the reader side cleans up
            self._closing = True
            self._room.set()

    def _report_written(self) -> None:
        stamps, on_written = self._stamps, self._on_written
        while stamps and stamps[0][0] <= self._written:
            _, stamp = stamps.popleft()
            if on_written is not None:
                on_written(stamp)

    def _pack(self, queue: deque[str]) -> str:
        """Pop the frames that fit in one message of at most `batch_bytes` UTF-8 bytes, the
        array's brackets and commas included (the receiver's limit is in bytes, not characters:
        counting characters let non-ASCII ops pass the cap several times over). A frame bigger
        than the cap alone still goes, alone and unwrapped: it cannot be split."""
        first = queue.popleft()
        batch = [first]
        size = _utf8_len(first) + 2  # "[" and "]"
        while queue:
            extra = _utf8_len(queue[0]) + 1  # the frame and its comma
            if size + extra > self.batch_bytes:
                break
            size += extra
            batch.append(queue.popleft())
        return first if len(batch) == 1 else f"[{','.join(batch)}]"

    async def aclose(self) -> None:
        for subscription in list(self.subscriptions.values()):
            subscription.stop()
        self._writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._writer


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())


_background: set[asyncio.Task[Any]] = set()


class Subscription:
    """One connection's subscription to one sub-doc: catch-up from the log, then live."""

    def __init__(
        self,
        hub: Hub,
        conn: Connection,
        workspace_id: str,
        sub_doc: str,
        since: int,
        *,
        page: int,
        pending_limit: int,
    ) -> None:
        self.hub = hub
        self.conn = conn
        self.workspace_id = workspace_id
        self.sub_doc = sub_doc
        self.cursor = Cursor(since)
        #: The `since` the client asked for: a refusal names it, so the client can tell it from
        #: a refusal of an earlier subscribe of the sub-doc still on its way.
        self.since = since
        self.page = page
        self.pending_limit = pending_limit
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # News of other instances' commits that came while the log was being read (not live).
        # The read in flight may have been answered before that commit, and `_wake` is cleared
        # once the subscription goes live, so this news must be kept here or it is lost: the
        # subscriber would stall short of the head until some later commit (none may come).
        self._known_head = 0  # a clock announced during the read in flight
        self._reread = False  # the LISTEN connection came back during the read: read again

    def start(self) -> None:
        # Register before the first log read: see fanout's docstring.
        self.hub._add(self)
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        self.hub._remove(self)
        if self._task is not None:
            self._task.cancel()

    # Called synchronously by the hub, in commit order.
    def on_frames(self, frames: list[Frame]) -> None:
        for frame in self.cursor.offer(frames):
            if not self.conn.send(frame.text, frame.stamp):
                return
        if not self.cursor.live:
            if len(self.cursor.pending) > self.pending_limit:
                # Catch-up, not the peer, is behind: the log holds these frames, so forget them
                # and read on. Closing with 4008 here cut off a reader that kept up with its
                # catch-up whenever more than the limit was committed meanwhile (a client writing
                # as it reads), and at every reconnect again. Memory stays bounded either way.
                self.cursor.forget_pending()
            self._wake.set()

    def on_head(self, head: int) -> None:
        if self.cursor.behind(head):
            self._wake.set()
        elif not self.cursor.live:
            self._known_head = max(self._known_head, head)

    def catch_up(self) -> None:
        """News of commits may have been lost: re-read the log from where this subscriber
        stands (the log fills any gap; nothing is sent twice)."""
        if self.cursor.live:
            self.cursor.live = False
            self._wake.set()
        else:
            self._reread = True

    def _refuse(self, message: str) -> None:
        """End this subscription alone with an `invalid_field` error naming its sub-doc."""
        self.hub._remove(self)
        if self.conn.subscriptions.get(self.sub_doc) is self:
            del self.conn.subscriptions[self.sub_doc]
        self.conn.send_json(
            {
                "type": "error",
                "code": "invalid_field",
                "message": message,
                "sub_doc": self.sub_doc,
                "since": self.since,
            }
        )

    async def _snapshot_frame(self) -> str:
        """The sub-doc's state as a `snapshot` frame, the cursor moved to its clock."""
        clock, state = await self.hub.store.get_state(self.workspace_id, self.sub_doc)
        self.cursor.reset_to(clock)
        body = {"type": "snapshot", "sub_doc": self.sub_doc, "clock": clock}
        body["state"] = state.to_json()
        return orjson.dumps(body).decode()

    async def _run(self) -> None:
        store = self.hub.store
        synced = False
        try:
            while True:
                while True:
                    # One catch-up read at a time per connection: the sub-docs of one socket
                    # all saw the same half-empty queue, each added a page, and together they
                    # passed the limit (4008 at every reconnect of a healthy client).
                    async with self.hub.catch_up_lock(self.conn):
                        await self.conn.room()  # paced by the peer: see `Connection.room`
                        page = min(self.page, self.conn.catch_up_page)
                        # Cleared before the read is sent: news during it sets them again. News
                        # from before this read is covered by it; kept across reads, a head the
                        # log never reaches (a hand-sent NOTIFY, a failover that lost commits)
                        # had the subscription re-read the log in a tight loop, never synced.
                        self._reread = False
                        self._known_head = 0
                        head, entries = await store.read_since(
                            self.workspace_id, self.sub_doc, self.cursor.last, page
                        )
                        if not synced and self.cursor.last > head:
                            # A `since` past the head named clocks that do not exist yet:
                            # answered with `synced` at that clock, the ops later committed up
                            # to it were skipped as already sent, a silent loss (a client
                            # resuming against a restored or different database). Refuse it,
                            # naming the sub-doc.
                            self._refuse(f"since {self.cursor.last} is past the head clock {head}")
                            return
                        first = entries[0].clock if entries else None
                        if self.cursor.behind_horizon(first, head):
                            # The ops after `last` are compacted: the state instead, then the
                            # ops after its clock (docs/protocol.md, "Behind the horizon";
                            # `test_a_subscriber_from_clock_zero_after_compaction_gets_the_
                            # snapshot_then_the_tail`).
                            if not self.conn.send(await self._snapshot_frame()):
                                return
                            continue
                        frames = (self.hub.stamped(self, entry) for entry in entries)
                        for frame in self.cursor.from_log(frames):
                            if not self.conn.send(frame.text):
                                return
                    if len(entries) < page:
                        break
                await self.conn.room()  # what arrived meanwhile is flushed at once
                out, live = self.cursor.go_live()
                for frame in out:
                    if not self.conn.send(frame.text, frame.stamp):
                        return
                if not live:
                    continue
                if self._reread or self._known_head > self.cursor.last:
                    self.cursor.live = False  # news that came during the read: read once more
                    continue
                if not synced:
                    synced = True
                    self.conn.send_json(
                        {"type": "synced", "sub_doc": self.sub_doc, "clock": self.cursor.last}
                    )
                self._wake.clear()
                await self._wake.wait()
        except asyncio.CancelledError:
            raise
        except Exception:  # a failing read must not leave a silent, stuck subscriber
            log.exception("subscription %s/%s failed", self.workspace_id, self.sub_doc)
            self.conn.close(1011, b"subscription failed; reconnect")


class Hub:
    """Topic registry: (workspace_id, sub_doc) → live subscriptions."""

    def __init__(self, store: OpLogStore) -> None:
        self.store = store
        self._topics: dict[tuple[str, str], set[Subscription]] = {}
        # The commit stamps of the ops published lately, so that a subscriber that reads one of
        # them from the log (sent there by this instance's own notification arriving before the
        # publish, on a busy machine) still measures its lag from the commit: every frame of a
        # commit of this instance is measured once, whichever way it reached the socket.
        self._recent: OrderedDict[tuple[str, str, int], float] = OrderedDict()
        # Keyed weakly: a connection's lock goes with it.
        self._catch_up_locks: weakref.WeakKeyDictionary[Connection, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def subscriber_count(self) -> int:
        return sum(len(subs) for subs in self._topics.values())

    def publish(self, workspace_id: str, sub_doc: str, entries: Iterable[LogEntry]) -> None:
        """Call right after the commit that produced `entries`, never before."""
        subs = self._topics.get((workspace_id, sub_doc))
        if not subs:
            return
        stamp = time.perf_counter()
        frames = [
            Frame(frame.clock, frame.text, stamp)
            for frame in (encode_entry(sub_doc, entry) for entry in entries)
        ]
        recent = self._recent
        for frame in frames:
            recent[workspace_id, sub_doc, frame.clock] = stamp
        while len(recent) > _RECENT_STAMPS:
            recent.popitem(last=False)
        for sub in list(subs):
            sub.on_frames(frames)

    def stamped(self, sub: Subscription, entry: LogEntry) -> Frame:
        """`entry`, read from the log for `sub`, as a frame with its commit stamp when this
        instance published it lately (None otherwise: another instance's, or an old one)."""
        frame = encode_entry(sub.sub_doc, entry)
        stamp = self._recent.get((sub.workspace_id, sub.sub_doc, entry.clock))
        return frame if stamp is None else Frame(frame.clock, frame.text, stamp)

    def notify_head(self, workspace_id: str, sub_doc: str, head: int) -> None:
        """Another instance committed up to `head`: subscribers that are behind catch up."""
        for sub in list(self._topics.get((workspace_id, sub_doc), ())):
            sub.on_head(head)

    def wake_all(self) -> None:
        """The feed of other instances' commits was interrupted (the PostgreSQL LISTEN
        connection reconnected): every live subscriber catches up from the log."""
        for subs in list(self._topics.values()):
            for sub in list(subs):
                sub.catch_up()

    def catch_up_lock(self, conn: Connection) -> asyncio.Lock:
        """The lock the catch-up reads of `conn`'s subscriptions take turns on."""
        lock = self._catch_up_locks.get(conn)
        if lock is None:
            lock = self._catch_up_locks[conn] = asyncio.Lock()
        return lock

    def _add(self, sub: Subscription) -> None:
        self._topics.setdefault((sub.workspace_id, sub.sub_doc), set()).add(sub)

    def _remove(self, sub: Subscription) -> None:
        key = (sub.workspace_id, sub.sub_doc)
        subs = self._topics.get(key)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._topics[key]
