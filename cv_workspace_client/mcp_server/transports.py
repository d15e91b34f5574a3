"""The transports of the MCP server (`cv-workspace mcp`, docs/mcp.md): stdio, as agent hosts
start a tool server, and streamable HTTP. Each runs a built server (`mcp_server.build_server`)
until it is told to stop, and stops cleanly on a signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import stat
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import uvicorn
from mcp.server import MCPServer
from mcp.server.stdio import stdio_server
from mcp.server.transport_security import DEFAULT_MAX_REQUEST_BODY_SIZE

from cv_workspace_client.mcp_server.feeds import ResourceFeeds
from cv_workspace_client.worker import WorkerConfig

__all__ = ["DRAIN_SECONDS", "ListenFailed", "run_http", "run_stdio"]

_log = logging.getLogger(__name__)

#: How long a stopping HTTP server lets calls in progress finish (a `wait_request` may run for
#: minutes): the drain deadline of the deployment's other processes (`cv-worker`'s default; uvicorn
#: takes whole seconds).
DRAIN_SECONDS = math.ceil(WorkerConfig().drain_seconds)


async def run_stdio(server: MCPServer[None], feeds: ResourceFeeds) -> None:
    """Serve MCP over this process's stdin/stdout until the agent host closes stdin, or the
    task is cancelled (SIGTERM)."""
    lowlevel = server._lowlevel_server
    try:
        async with (
            _stdin_lines() as lines,
            stdio_server(stdin=lines) as (read_stream, write_stream),
        ):
            await lowlevel.run(read_stream, write_stream, lowlevel.create_initialization_options())
    finally:
        await feeds.close()


class _PipeLines:
    """stdin's lines read on the event loop. The `mcp` SDK reads stdin in a worker thread,
    which a cancel cannot interrupt: SIGTERM left the server blocked in that read until the
    host wrote a line or closed the pipe. A read here is cancelled like any await."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader

    def __aiter__(self) -> _PipeLines:
        return self

    async def __anext__(self) -> str:
        try:
            line = await self._reader.readline()
        except ValueError:  # longer than the limit: dropped up to its end, answered as garbage
            _log.warning("an MCP message over %d bytes was dropped", DEFAULT_MAX_REQUEST_BODY_SIZE)
            return "\n"
        if not line:
            raise StopAsyncIteration
        return line.decode("utf-8", errors="replace")


@contextlib.asynccontextmanager
async def _stdin_lines() -> AsyncIterator[Any]:
    """`_PipeLines` over stdin when it is a pipe or a socket (how hosts start tool servers);
    None (the SDK's own reader) otherwise: a file or a terminal cannot be read on the loop."""
    loop = asyncio.get_running_loop()
    try:
        mode = os.fstat(0).st_mode
    except OSError:
        yield None
        return
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        yield None
        return
    # The MCP SDK's own bound on one message over HTTP, for one line here.
    reader = asyncio.StreamReader(limit=DEFAULT_MAX_REQUEST_BODY_SIZE, loop=loop)
    pipe = os.fdopen(os.dup(0), "rb", buffering=0)
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader, loop=loop), pipe
    )
    try:
        yield _PipeLines(reader)
    finally:
        transport.close()


async def run_http(
    server: MCPServer[None],
    feeds: ResourceFeeds,
    host: str,
    port: int,
    *,
    ready: Callable[[str], None],
) -> None:
    """Serve MCP over streamable HTTP at `http://host:port/mcp` until cancelled; `ready` is
    given that URL once the socket listens (`port` 0: a free port)."""
    app = server.streamable_http_app(host=host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:  # in use, not an address of this host, not a host at all
        sock.close()
        raise ListenFailed(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    sock.listen()
    config = uvicorn.Config(
        app, log_level="warning", lifespan="on", timeout_graceful_shutdown=DRAIN_SECONDS
    )
    runner = _Uvicorn(config, feeds)
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    handled = threading.current_thread() is threading.main_thread()
    if handled:
        for sig in signals:  # a graceful stop: open requests finish, then exit 0
            loop.add_signal_handler(sig, runner.stop)
    try:
        ready(f"http://{shown}:{bound}/mcp")
        await runner.serve(sockets=[sock])
    finally:
        if handled:
            for sig in signals:
                loop.remove_signal_handler(sig)
        sock.close()
        await feeds.close()


class ListenFailed(Exception):
    """The HTTP transport cannot listen where it was asked to (the message says why)."""


class _Uvicorn(uvicorn.Server):
    """uvicorn's server with the process's signals left to `serve_http`: uvicorn's own
    handlers re-raised the signal once it had stopped, which cancelled its lifespan task
    mid-shutdown (a traceback on stderr at every SIGTERM)."""

    def __init__(self, config: uvicorn.Config, feeds: ResourceFeeds) -> None:
        super().__init__(config)
        self._feeds = feeds

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def stop(self) -> None:
        """Stop accepting, end the listen streams (they never end by themselves), let the
        calls in progress finish within `DRAIN_SECONDS`, then stop."""
        self._feeds.end_streams()
        self.should_exit = True
