"""What one websocket connection of the SDK does on the wire, beside the protocol: its one
writer (frames packed into messages within the server's byte limit), a ping that tolerates a
closing connection, and giving the connection back however it ended. Used by `_io/socket.py`."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

__all__ = ["ping", "release", "utf8_len", "write_frames"]


async def ping(ws: aiohttp.ClientWebSocketResponse) -> None:
    # A connection closing meanwhile fails the write; the read reports it.
    with contextlib.suppress(ConnectionError, aiohttp.ClientError, RuntimeError):
        await ws.ping()


def release(ws: aiohttp.ClientWebSocketResponse) -> None:
    """Give the connection under `ws` back (closed) once it is done with, however it ended.

    aiohttp's `receive` marks a websocket closed without releasing its connection when the
    connection was lost (its `ClientError` branch), and `close()` is then a no-op: the
    connection stayed referenced until garbage collection (a ResourceWarning). It is also how
    the heartbeat drops a dead connection. `ClientResponse.close()` is idempotent;
    the response is reached through a private attribute, so its absence is tolerated."""
    response = getattr(ws, "_response", None)
    if isinstance(response, aiohttp.ClientResponse):
        response.close()


async def write_frames(
    ws: aiohttp.ClientWebSocketResponse, frames: asyncio.Queue[str], max_bytes: int
) -> None:
    """The connection's one writer: frames leave in the order they were queued. Frames that
    queued up meanwhile (the applies of many writers sharing this client) leave as one message,
    a JSON array of frames, up to `max_bytes`: one write here and one read at the server."""
    try:
        while True:
            first = await frames.get()
            if frames.empty():
                await ws.send_str(first)
                continue
            # `size` is the packed message's length in UTF-8 bytes: the server's frame limit
            # (aiohttp `max_msg_size`) counts bytes, and an op's text may be non-ASCII. Counting
            # characters packed two valid 600 KB CJK batches into one 1.2 MB message; the server
            # closed the socket (1009) and the larger op was failed as `body_too_large` though it
            # fits alone. `[`, `]` and one comma per extra frame are counted too.
            batch, size = [first], utf8_len(first) + 2
            while not frames.empty():
                frame = frames.get_nowait()
                frame_size = utf8_len(frame)
                if size + frame_size + 1 > max_bytes:
                    await ws.send_str(_pack(batch))
                    batch, size = [], 2
                batch.append(frame)
                size += frame_size + (1 if len(batch) > 1 else 0)
            await ws.send_str(_pack(batch))
    except (ConnectionError, aiohttp.ClientError, RuntimeError):
        # The reader sees the close and reports every in-flight batch as failed.
        with contextlib.suppress(Exception):
            await ws.close()


def utf8_len(text: str) -> int:
    """Bytes of `text` once encoded (`isascii` is O(1): no encoding on the common path)."""
    return len(text) if text.isascii() else len(text.encode())


def _pack(frames: list[str]) -> str:
    return frames[0] if len(frames) == 1 else f"[{','.join(frames)}]"
