"""A websocket that closes on a refused frame without resetting the connection.

When aiohttp's frame reader refuses what the peer sends (a frame past `max_msg_size`: 1009; text
that is not UTF-8: 1007; a protocol error: 1002) it writes the close frame and closes the TCP
connection at once, while the peer is typically still sending the rest of that frame. Closing a
socket with unread data, or receiving data after it is closed, makes the kernel answer with a
reset; the peer's next write then fails with ECONNRESET and its transport is torn down before it
reads the close frame waiting in its buffer: the client saw a connection reset instead of the
1009 (every time for a sender slower than loopback, now and then on loopback).

Here the connection lingers instead, as HTTP servers do for a refused body: the close frame goes
out, the write side is shut (the peer reads the close frame, then end-of-stream), and what the
peer still sends is read and discarded until it closes its side, for at most `linger_seconds`.
Pinned by tests/server/http/test_socket_frames.py.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

from aiohttp import web
from aiohttp.http_websocket import WebSocketError
from aiohttp.web_request import BaseRequest

__all__ = ["LINGER_SECONDS", "LingeringWebSocketResponse"]

#: How long a refused peer may go on sending before the connection is closed regardless:
#: aiohttp's own bound on a websocket close handshake (`WebSocketResponse(timeout=10.0)`).
LINGER_SECONDS: Final = 10.0


class _Discard(asyncio.Protocol):
    """Takes a transport over from aiohttp's protocol once the websocket is over: discards what
    the peer still sends, and passes flow control and the connection's end on to the protocol
    it replaced (so aiohttp still sees the connection lost, and forgets it)."""

    def __init__(self, replaced: asyncio.BaseProtocol) -> None:
        self._replaced = replaced
        self.gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # the peer has stopped sending: the transport closes

    def pause_writing(self) -> None:
        self._replaced.pause_writing()

    def resume_writing(self) -> None:
        self._replaced.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._replaced.connection_lost(exc)
        finally:
            if not self.gone.done():
                self.gone.set_result(None)


class LingeringWebSocketResponse(web.WebSocketResponse):
    """`web.WebSocketResponse` that lingers after its reader refused a frame (module docstring).

    The handler must `await lingered()` before it returns: aiohttp closes the transport when
    the handler is done.
    """

    def __init__(self, *, linger_seconds: float = LINGER_SECONDS, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._linger_seconds = linger_seconds
        self._request_seen: BaseRequest | None = None
        self._discard: _Discard | None = None

    async def prepare(self, request: BaseRequest) -> Any:
        self._request_seen = request
        return await super().prepare(request)

    def _close_transport(self) -> None:
        request = self._request_seen
        transport = request.transport if request is not None else None
        if self._discard is not None:
            return  # lingering: the peer's end, or the deadline, closes it
        if not isinstance(self.exception(), WebSocketError) or transport is None:
            super()._close_transport()
            return
        if transport.is_closing() or not transport.can_write_eof():
            transport.close()
            return
        discard = _Discard(transport.get_protocol())
        transport.set_protocol(discard)
        transport.write_eof()  # after the close frame, already written
        if not transport.is_reading():  # aiohttp's flow control may have paused it
            transport.resume_reading()
        deadline = asyncio.get_running_loop().call_later(self._linger_seconds, transport.close)
        discard.gone.add_done_callback(lambda _: deadline.cancel())
        self._discard = discard

    async def lingered(self) -> None:
        """Return once the connection is closed, if it is lingering; at once otherwise."""
        if self._discard is not None:
            await self._discard.gone
