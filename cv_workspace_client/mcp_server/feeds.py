"""Resource-update notifications of the MCP server (`cv-workspace mcp`, docs/mcp.md): a sub-doc's
resource `cv://{workspace_id}/docs/{sub_doc}` is "updated" each time an op is committed to it.

One SDK subscription (`WorkspaceClient.subscribe`) per subscribed sub-doc, however many MCP
sessions and listen streams follow it, started at the first subscriber and ended with the last.
Each committed op it yields is published two ways, one per protocol era the `mcp` SDK serves:

- 2026-07-28 connections open a `subscriptions/listen` stream naming the URIs; the event goes on
  the server's subscription bus, and the SDK's listen handler routes it to the streams that
  asked for that URI.
- Earlier (handshake-era) connections send `resources/subscribe`; the event is sent to each
  such session as `notifications/resources/updated`. A session that cannot be written to any
  more (it ended) is forgotten.

Notifications say *that* the resource changed; the client reads it again (`resources/read`).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable

from mcp.server.connection import Connection
from mcp.server.session import ServerSession
from mcp.server.subscriptions import ListenHandler, ResourceUpdated, SubscriptionBus

from cv_workspace_client._io.retry import is_retryable
from cv_workspace_client.client import WorkspaceClient
from cv_workspace_client.errors import LogCompactedError, WorkspaceError

__all__ = ["DOC_URI", "ResourceFeeds", "doc_uri", "parse_doc_uri"]

_log = logging.getLogger(__name__)

#: The resource template of a sub-doc's state.
DOC_URI = "cv://{workspace_id}/docs/{sub_doc}"
_DOC_URI = re.compile(r"^cv://(?P<workspace_id>[^/]+)/docs/(?P<sub_doc>[^/]+)$")


def doc_uri(workspace_id: str, sub_doc: str) -> str:
    return f"cv://{workspace_id}/docs/{sub_doc}"


def parse_doc_uri(uri: str) -> tuple[str, str] | None:
    """`(workspace_id, sub_doc)` of a sub-doc's URI, or None for any other URI."""
    match = _DOC_URI.match(uri)
    return None if match is None else (match["workspace_id"], match["sub_doc"])


class _Feed:
    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        #: Set once the feed knows the sub-doc's head (every commit after it will be told), or
        #: has stopped: what a subscription's acknowledgment waits for.
        self.ready = asyncio.Event()
        #: Listen streams following it (2026-07-28).
        self.listeners = 0
        #: Handshake-era connections subscribed to it.
        self.sessions: set[Connection] = set()

    @property
    def idle(self) -> bool:
        return self.listeners == 0 and not self.sessions


class ResourceFeeds:
    """The running SDK subscriptions, keyed by resource URI. Call from the server's loop only."""

    def __init__(self, client: WorkspaceClient, bus: SubscriptionBus) -> None:
        self._client = client
        self._bus = bus
        self._feeds: dict[str, _Feed] = {}
        #: The listen streams' handler, once the server serves them (`end_streams`).
        self.streams: ListenHandler | None = None

    @property
    def uris(self) -> frozenset[str]:
        """The URIs with a running feed (for tests and `/metrics`-like introspection)."""
        return frozenset(self._feeds)

    async def listen(self, uris: list[str]) -> Callable[[], None]:
        """A listen stream follows `uris` (those that are sub-doc URIs), from when this returns:
        a commit after it is told (`ready`). The returned callable ends that (idempotent)."""
        taken: dict[str, _Feed] = {}
        for uri in dict.fromkeys(uris):
            if parse_doc_uri(uri) is not None:
                feed = taken[uri] = self._feed(uri)
                feed.listeners += 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            for uri, feed in taken.items():
                # Only the feed this stream counted in: one that stopped (its sub-doc refused)
                # may have been replaced by another subscriber's, which this stream never held.
                if self._feeds.get(uri) is feed:
                    feed.listeners -= 1
                    self._stop_if_idle(uri)

        try:
            for feed in taken.values():
                await feed.ready.wait()
        except BaseException:  # cancelled while waiting: nothing follows these for this stream
            release()
            raise
        return release

    async def subscribe(self, session: ServerSession, uri: str) -> None:
        """A handshake-era client subscribes to `uri` (a sub-doc URI: checked by the caller),
        from when this returns: a commit after it is told."""
        feed = self._feed(uri)
        feed.sessions.add(_connection_of(session))
        await feed.ready.wait()

    def unsubscribe(self, session: ServerSession, uri: str) -> None:
        self._forget(_connection_of(session), uri)

    def _forget(self, connection: Connection, uri: str) -> None:
        feed = self._feeds.get(uri)
        if feed is not None:
            feed.sessions.discard(connection)
            self._stop_if_idle(uri)

    def end_streams(self) -> None:
        """End every open listen stream gracefully (its client sees the end, not a drop): a
        server stopping must not wait for streams that never end by themselves."""
        if self.streams is not None:
            self.streams.close()

    async def close(self) -> None:
        tasks = [feed.task for feed in self._feeds.values() if feed.task is not None]
        self._feeds.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _feed(self, uri: str) -> _Feed:
        feed = self._feeds.get(uri)
        if feed is None:
            feed = self._feeds[uri] = _Feed()
            loop = asyncio.get_running_loop()
            feed.task = loop.create_task(self._follow(uri, feed), name=f"feed {uri}")
        return feed

    def _stop_if_idle(self, uri: str) -> None:
        feed = self._feeds.get(uri)
        if feed is not None and feed.idle:
            del self._feeds[uri]
            if feed.task is not None:
                feed.task.cancel()

    async def _follow(self, uri: str, feed: _Feed) -> None:
        ids = parse_doc_uri(uri)
        assert ids is not None
        workspace_id, sub_doc = ids
        changed = asyncio.Event()
        publisher = asyncio.get_running_loop().create_task(self._publisher(uri, changed))
        try:
            # From the head: a subscriber is told of what changes after it subscribed (it reads
            # the resource for the state before). The SDK resumes across reconnects by clock, so
            # no commit is missed while the feed runs.
            head = await self._head(workspace_id, sub_doc)
            feed.ready.set()
            # `async with`: a feed stopped (its last subscriber gone) unsubscribes at once,
            # not when the collector gets round to the dropped subscription.
            async with self._client.subscribe(workspace_id, sub_doc, since=head) as committed:
                async for _op in committed:
                    changed.set()
        except asyncio.CancelledError:
            raise
        except WorkspaceError as exc:
            # A token that does not grant the workspace, an invalid id: this feed cannot run.
            # Nothing is published; a later subscribe starts it again.
            _log.warning("resource feed %s stopped: %s", uri, exc)
        finally:
            publisher.cancel()
            feed.ready.set()  # stopped: a subscription waiting on it is acknowledged, silent
            if self._feeds.get(uri) is feed:
                del self._feeds[uri]

    async def _publisher(self, uri: str, changed: asyncio.Event) -> None:
        """One notification for every run of commits that arrived while the last was being
        published: a burst (3,000 ops in one `apply_ops`) told op by op overflowed each listen
        stream's backlog (1,024 events in the `mcp` SDK), which then ends the stream. A commit
        after a notification's publication always gets one of its own: the flag is cleared
        before publishing (test_a_burst_of_commits_leaves_the_listen_stream_open)."""
        while True:
            await changed.wait()
            changed.clear()
            await self._publish(uri)

    async def _head(self, workspace_id: str, sub_doc: str) -> int:
        """The sub-doc's head clock, read again with the client's backoff while the server
        cannot be reached (the subscription after it resumes by itself; this read must too)."""
        failures = 0
        while True:
            try:
                try:
                    head, _ = await self._client.read_ops(workspace_id, sub_doc, since=0, limit=1)
                except LogCompactedError as exc:  # the 410 names the head too
                    if exc.clock is None:
                        raise
                    head = exc.clock
                return head
            except WorkspaceError as exc:
                if not is_retryable(exc):
                    raise
                failures += 1
                await self._client.config.sleep(self._client.backoff(failures))

    async def _publish(self, uri: str) -> None:
        await self._bus.publish(ResourceUpdated(uri=uri))
        feed = self._feeds.get(uri)
        for connection in list(feed.sessions if feed is not None else ()):
            try:
                await connection.send_resource_updated(uri)
            except Exception:  # the connection's transport is gone (its client left): forget it
                _log.debug("resource feed %s: connection gone", uri, exc_info=True)
                self._forget(connection, uri)


def _connection_of(session: ServerSession) -> Connection:
    """The client connection a request's session belongs to. The `mcp` SDK makes a session per
    request: a subscription is the connection's (its `unsubscribe` comes in another request's
    session), and its notifications go on the connection's own channel. No public accessor."""
    connection: Connection = session._connection
    return connection
