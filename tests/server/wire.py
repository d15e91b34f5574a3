"""Raw HTTP and raw websocket frames over a real loopback socket, against the app served the way
`cv-server serve` serves it (`ServerRunner`): for what aiohttp's client would normalise (content
codings, over-long headers, frame sizes, integers past 64 bits)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from cv_server import ServerConfig, create_app
from cv_server.serving import ServerRunner
from tests.server.conftest import token_for

#: Every read from the server is bounded: a server that fails to answer fails the test.
BOUND = 10.0


@dataclass
class Served:
    app: web.Application
    port: int


@asynccontextmanager
async def served(config: ServerConfig) -> AsyncIterator[Served]:
    """The app of `config` on an ephemeral port of 127.0.0.1, through `ServerRunner`."""
    app = create_app(config)
    runner = ServerRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield Served(app, runner.addresses[0][1])
    finally:
        await runner.cleanup()


@dataclass
class RawAnswer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def raw_http(port: int, request: bytes) -> RawAnswer:
    """Send `request` as is on a new connection; read one answer (the server closes or says
    how long it is)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(BOUND):
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {}
            for line in lines[1:]:
                if ":" in line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            length = headers.get("content-length")
            body = await (reader.readexactly(int(length)) if length else reader.read())
        return RawAnswer(status, headers, body)
    finally:
        writer.close()


def post(
    path: str,
    body: bytes,
    *,
    workspace: str = "ws1",
    headers: dict[str, str] | None = None,
) -> bytes:
    """A raw POST with a bearer token for `workspace`, `Content-Length` and `headers` as given."""
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: 127.0.0.1",
        f"Authorization: Bearer {token_for(workspace)}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def mask(payload: bytes, key: bytes) -> bytes:
    """RFC 6455 masking, at C speed (a megabyte frame in milliseconds)."""
    n = len(payload)
    if not n:
        return b""
    keys = (key * (n // 4 + 1))[:n]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(keys, "big")).to_bytes(n, "big")


def frame(payload: bytes, opcode: int = 0x1) -> bytes:
    """One final, masked client frame."""
    key = os.urandom(4)
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
    return head + key + mask(payload, key)


class RawSocket:
    """A websocket client that sends exactly the bytes it is given and reads frames as they come."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.close_code: int | None = None

    @classmethod
    async def connect(
        cls, port: int, workspace: str = "ws1", *, send_buffer: int | None = None
    ) -> RawSocket:
        """Open and upgrade. `send_buffer` shrinks the kernel's send buffer (SO_SNDBUF): a big
        frame then leaves as slowly as the server reads it, as over a real link."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if send_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            (
                f"GET /v1/workspaces/{workspace}/socket HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                f"Authorization: Bearer {token_for(workspace)}\r\n\r\n"
            ).encode()
        )
        await writer.drain()
        async with asyncio.timeout(BOUND):
            head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101"), head
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def send_text(self, text: str | bytes) -> None:
        await self.send(frame(text.encode() if isinstance(text, str) else text))

    async def send_json(self, value: Any) -> None:
        await self.send_text(json.dumps(value))

    async def receive(self) -> tuple[int, bytes]:
        """The next frame (opcode, payload); a close frame sets `close_code`. Raises
        `asyncio.IncompleteReadError` at end of stream."""
        async with asyncio.timeout(BOUND):
            first, second = await self.reader.readexactly(2)
            n = second & 0x7F
            if n == 126:
                (n,) = struct.unpack("!H", await self.reader.readexactly(2))
            elif n == 127:
                (n,) = struct.unpack("!Q", await self.reader.readexactly(8))
            payload = await self.reader.readexactly(n)
        opcode = first & 0x0F
        if opcode == 0x8:
            self.close_code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
        return opcode, payload

    async def next_json(self, *types: str) -> dict[str, Any]:
        """The next text frame whose `type` is one of `types` (or any, if none is given)."""
        while True:
            opcode, payload = await self.receive()
            assert opcode != 0x8, f"closed with {self.close_code}: {payload[2:]!r}"
            if opcode != 0x1:
                continue
            value: dict[str, Any] = json.loads(payload)
            if not types or value["type"] in types:
                return value

    async def close(self) -> None:
        self.writer.close()
        with suppress(ConnectionError):
            await self.writer.wait_closed()
