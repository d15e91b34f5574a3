"""`FaultProxy`: a loopback TCP proxy that breaks connections on demand, with `CutRule` and
`ProxyStats`. Apps' tests import it from `cv_workspace_client.testing`, whose docstring is its
guide (docs/client.md); the demo's flaky network (`cv_workspace_client.stages.demo`) uses it from
here, as no module the product runs imports `testing`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = ["CutRule", "FaultProxy", "ProxyStats"]

_CHUNK = 64 * 1024


@dataclass(frozen=True, slots=True)
class CutRule:
    """When to cut one connection: after `skip_chunks` server chunks were forwarded intact, the
    next one is dropped (or only its first `forward_bytes` forwarded) and both sides aborted."""

    skip_chunks: int = 0
    forward_bytes: int = 0


@dataclass(slots=True)
class ProxyStats:
    accepted: int = 0
    refused: int = 0
    #: Connections cut by a rule (mid-frame cuts included).
    cuts: int = 0
    mid_frame_cuts: int = 0
    #: Connections aborted by `drop_all`.
    dropped: int = 0
    #: Connections made silent by `silence_open`.
    silenced: int = 0
    open: int = 0


class _Link:
    """One proxied connection: the client's and the server's stream writers, and its fate."""

    __slots__ = ("client", "dead", "rule", "server", "server_chunks", "silent")

    def __init__(self, client: asyncio.StreamWriter, server: asyncio.StreamWriter) -> None:
        self.client = client
        self.server = server
        self.rule: CutRule | None = None
        self.server_chunks = 0
        self.dead = False
        #: Bytes are swallowed both ways (see `FaultProxy.silence_open`).
        self.silent = False

    def abort(self) -> None:
        self.dead = True
        for writer in (self.client, self.server):
            writer.transport.abort()


class FaultProxy:
    """A loopback TCP proxy in front of `upstream` (a URL like `http://127.0.0.1:8080`).

    Start with `async with FaultProxy(url) as proxy` (or `await proxy.start()` / `await
    proxy.close()`); point clients at `proxy.url`.
    """

    def __init__(self, upstream: str, *, host: str = "127.0.0.1", seed: int = 0) -> None:
        parts = urlsplit(upstream)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"upstream must be a URL with host and port, got {upstream!r}")
        self.upstream_host = parts.hostname
        self.upstream_port = parts.port
        self.host = host
        self.port = 0
        #: Seconds to hold each server chunk before forwarding it.
        self.delay = 0.0
        #: While True, new connections are aborted as soon as they are accepted.
        self.refuse = False
        self.stats = ProxyStats()
        self._random = random.Random(seed)
        self._armed: deque[CutRule] = deque()
        self._fraction = 0.0
        self._fraction_rule = CutRule()
        self._chunk_probability = 0.0
        self._chunk_rule = CutRule()
        self._links: set[_Link] = set()
        #: Accepted clients whose link to the server is still being opened.
        self._connecting: set[asyncio.StreamWriter] = set()
        self._closing = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None
        self._changed = asyncio.Condition()

    @property
    def url(self) -> str:
        """Where clients connect (`http://127.0.0.1:<port>`)."""
        return f"http://{self.host}:{self.port}"

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._handle, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        # A connection accepted just before the close may have a handler that has not started
        # yet (3.11's `wait_closed` does not wait for it) or that is still connecting upstream:
        # `_closing` makes a late handler abort its client, and `_connecting` lets the close
        # abort a half-open one, so no client is left hanging on a proxy that is gone.
        self._closing = True
        if self._server is not None:
            self._server.close()
        while self._tasks:
            self._abort_all()
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- faults ------------------------------------------------------------------------------------

    def cut_next(self, n: int = 1, *, skip_chunks: int = 0, forward_bytes: int = 0) -> None:
        """Arm the next `n` new connections (see the module docstring)."""
        self._armed.extend([CutRule(skip_chunks, forward_bytes)] * n)

    def cut_fraction(
        self, fraction: float, *, skip_chunks: int = 0, forward_bytes: int = 0
    ) -> None:
        """Arm each new connection with probability `fraction` (0 turns it off)."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError("fraction must be within [0, 1]")
        self._fraction = fraction
        self._fraction_rule = CutRule(skip_chunks, forward_bytes)

    def cut_chunks(
        self, probability: float, *, skip_chunks: int = 0, forward_bytes: int = 0
    ) -> None:
        """Cut at each server chunk (after every connection's first `skip_chunks`) with
        `probability` (0 turns it off)."""
        if not 0.0 <= probability <= 1.0:
            raise ValueError("probability must be within [0, 1]")
        self._chunk_probability = probability
        self._chunk_rule = CutRule(skip_chunks, forward_bytes)

    def cut_open(self, *, skip_chunks: int = 0, forward_bytes: int = 0) -> int:
        """Arm every open connection: each is cut at its next server chunk (after `skip_chunks`
        more). Returns how many were armed."""
        live = [link for link in self._links if not link.dead]
        for link in live:
            link.rule = CutRule(link.server_chunks + skip_chunks, forward_bytes)
        return len(live)

    def silence_open(self) -> int:
        """Make every open connection silent both ways without closing it (see the module
        docstring); returns how many. New connections are not affected."""
        live = [link for link in self._links if not link.dead and not link.silent]
        for link in live:
            link.silent = True
        self.stats.silenced += len(live)
        return len(live)

    def drop_all(self) -> int:
        """Abort every open connection now (those still connecting to the server included);
        returns how many."""
        dropped = self._abort_all()
        self.stats.dropped += dropped
        return dropped

    def _abort_all(self) -> int:
        links = [link for link in self._links if not link.dead]
        for link in links:
            link.abort()
        connecting = [w for w in self._connecting if not w.transport.is_closing()]
        for writer in connecting:
            writer.transport.abort()
        return len(links) + len(connecting)

    async def wait_until(self, predicate: Callable[[ProxyStats], bool]) -> None:
        """Wait until `predicate(stats)` holds; bound it with `asyncio.timeout`."""
        async with self._changed:
            await self._changed.wait_for(lambda: predicate(self.stats))

    # -- plumbing ----------------------------------------------------------------------------------

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._proxy(client_r, client_w)
        except asyncio.CancelledError:
            # `close()` cancels handlers; asyncio's streams would log a cancelled handler task
            # as an error, so it ends normally instead (it is the top of its own task).
            pass
        finally:
            self._tasks.discard(task)
            await self._notify()

    async def _proxy(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self._closing:
            client_w.transport.abort()
            return
        if self.refuse:
            self.stats.refused += 1
            client_w.transport.abort()
            return
        self._connecting.add(client_w)
        try:
            server_r, server_w = await asyncio.open_connection(
                self.upstream_host, self.upstream_port
            )
        except OSError:  # the server is down: the client sees a reset, as it would without us
            client_w.transport.abort()
            return
        except BaseException:  # `close()` cancelled us mid-connect: the client must hear it too
            client_w.transport.abort()
            raise
        finally:
            self._connecting.discard(client_w)
        if client_w.transport.is_closing():  # dropped (or closed) while connecting
            server_w.transport.abort()
            return
        self.stats.accepted += 1
        link = _Link(client_w, server_w)
        if self._armed:
            link.rule = self._armed.popleft()
        elif self._fraction and self._random.random() < self._fraction:
            link.rule = self._fraction_rule
        self._links.add(link)
        self.stats.open += 1
        await self._notify()
        up = asyncio.create_task(self._client_to_server(client_r, link))
        down = asyncio.create_task(self._server_to_client(server_r, link))
        try:
            # Each direction runs until its sender's EOF, which is passed on (a half-close, as
            # TCP allows); a cut, a drop or a reset on either side aborts both.
            await asyncio.wait({up, down})
        finally:
            try:
                for task in (up, down):
                    task.cancel()
                await asyncio.gather(up, down, return_exceptions=True)
                if not link.dead:
                    # Both sides ended on their own: what is still buffered must reach its
                    # peer before the sockets go (an abort would throw the tail away).
                    for writer in (link.client, link.server):
                        writer.close()
                    with contextlib.suppress(ConnectionError, OSError):
                        await asyncio.gather(link.client.wait_closed(), link.server.wait_closed())
            finally:
                link.abort()
                self._links.discard(link)
                self.stats.open -= 1

    async def _client_to_server(self, reader: asyncio.StreamReader, link: _Link) -> None:
        try:
            while data := await reader.read(_CHUNK):
                if link.silent:
                    continue
                link.server.write(data)
                await link.server.drain()
            if link.server.can_write_eof() and not link.silent:
                link.server.write_eof()
        except (ConnectionError, OSError):
            link.abort()  # a reset on one side is a reset on the other

    async def _server_to_client(self, reader: asyncio.StreamReader, link: _Link) -> None:
        try:
            await self._forward_down(reader, link)
        except (ConnectionError, OSError):
            link.abort()

    async def _forward_down(self, reader: asyncio.StreamReader, link: _Link) -> None:
        while data := await reader.read(_CHUNK):
            if link.silent:
                continue
            rule = link.rule
            if rule is None or link.server_chunks < rule.skip_chunks:
                rule = self._chunk_fate(link)
            if rule is not None and link.server_chunks >= rule.skip_chunks:
                if rule.forward_bytes > 0:
                    link.client.write(data[: rule.forward_bytes])
                    with contextlib.suppress(ConnectionError, OSError):
                        await link.client.drain()
                    self.stats.mid_frame_cuts += 1
                self.stats.cuts += 1
                link.abort()
                return
            link.server_chunks += 1
            if self.delay > 0:
                await asyncio.sleep(self.delay)
            link.client.write(data)
            await link.client.drain()
        # The server is done talking but may still be listening (a half-close): pass the
        # EOF on, after what is buffered, and keep forwarding what the client sends.
        if link.client.can_write_eof() and not link.silent:
            link.client.write_eof()

    def _chunk_fate(self, link: _Link) -> CutRule | None:
        rule = self._chunk_rule
        if (
            self._chunk_probability > 0
            and link.server_chunks >= rule.skip_chunks
            and self._random.random() < self._chunk_probability
        ):
            return rule
        return None
