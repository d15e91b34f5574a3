"""`cv_workspace_client.testing.FaultProxy` and `restart_client` checked against servers on loopback
that record what they received: if the tool's faults are not what they say, every replay test built
on them passes vacuously."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import WSMsgType, web
from aiohttp.test_utils import TestServer

from cv_mutations import NodeIncrement, NodeInsert
from cv_workspace_client import StillPendingError, WorkspaceClient
from cv_workspace_client.testing import FaultProxy, ProxyStats, restart_client

from .helpers import WS, fast_config, server_log

TIMEOUT = 20
ServerFactory = Callable[..., Awaitable[TestServer]]
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


# -- servers that record what reached them ---------------------------------------------------------


@contextlib.asynccontextmanager
async def tcp_server(handler: Handler) -> AsyncIterator[str]:
    """A raw TCP server on loopback running `handler` per connection; yields its URL."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def read_to_end(reader: asyncio.StreamReader) -> tuple[bytes, bool]:
    """Everything until the peer closes: (bytes, whether it ended with a reset)."""
    data = bytearray()
    try:
        while chunk := await reader.read(65536):
            data += chunk
    except ConnectionError:
        return bytes(data), True
    return bytes(data), False


async def connect(proxy: FaultProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(proxy.host, proxy.port)


async def hang_up(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


def settled(stats: ProxyStats) -> bool:
    return stats.open == 0


class Recorder:
    """What an aiohttp app received: request bodies, answers written, websocket messages."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.answered = 0
        self.sockets = 0
        self.messages: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/commit", self.commit)
        app.router.add_get("/ws", self.websocket)
        return app

    async def commit(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.bodies.append(body)
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(hashlib.sha256(body).hexdigest().encode())
        await response.write_eof()
        self.answered += 1  # the answer left the handler whole
        return response

    async def websocket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.sockets += 1
        async for msg in ws:
            if msg.type != WSMsgType.TEXT:
                break
            self.messages.append(msg.data)
            if msg.data.startswith("burst:"):
                for i in range(int(msg.data.removeprefix("burst:"))):
                    await ws.send_str(str(i))
            else:
                await ws.send_str(msg.data)
        return ws


@pytest.fixture
async def recorder_url(aiohttp_server: ServerFactory, recorder: Recorder) -> str:
    server = await aiohttp_server(recorder.app())
    return str(server.make_url("")).rstrip("/")


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


# -- cut_next: the worst moment -------------------------------------------------------------------


async def test_cut_next_delivers_the_whole_request_and_loses_the_whole_answer(
    recorder_url: str, recorder: Recorder
) -> None:
    body = random.Random(1).randbytes(300_000)  # several chunks on the way up
    async with FaultProxy(recorder_url) as proxy, aiohttp.ClientSession() as session:
        proxy.cut_next(1)
        with pytest.raises(aiohttp.ClientConnectionError):
            async with session.post(f"{proxy.url}/commit", data=body) as response:
                await response.read()
        assert recorder.bodies == [body]  # the server had all of it ...
        assert recorder.answered == 1  # ... and answered
        assert (proxy.stats.cuts, proxy.stats.mid_frame_cuts) == (1, 0)

        # The same cut seen byte by byte: not one byte of the answer reaches the client.
        proxy.cut_next(1)
        reader, writer = await connect(proxy)
        writer.write(
            b"POST /commit HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
            b"Connection: close\r\n\r\nhello"
        )
        received, _ = await asyncio.wait_for(read_to_end(reader), TIMEOUT)
        await hang_up(writer)
        assert received == b""
        assert recorder.bodies[-1] == b"hello"
        assert recorder.answered == 2
        assert proxy.stats.cuts == 2

        # An unarmed connection is untouched.
        async with session.post(f"{proxy.url}/commit", data=b"again") as response:
            assert await response.text() == hashlib.sha256(b"again").hexdigest()


async def test_forward_bytes_forwards_exactly_that_much_of_the_fatal_chunk() -> None:
    first = b"A" * 100
    fatal = bytes(range(256)) * 4

    async def ping_pong(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            for answer in (first, fatal):
                await reader.readline()
                writer.write(answer)  # one write, one chunk: the client asks before the next
                await writer.drain()
            await reader.read()
        writer.close()

    async with tcp_server(ping_pong) as url, FaultProxy(url) as proxy:
        proxy.cut_next(1, skip_chunks=1, forward_bytes=137)
        reader, writer = await connect(proxy)
        writer.write(b"1\n")
        assert await asyncio.wait_for(reader.readexactly(len(first)), TIMEOUT) == first
        writer.write(b"2\n")
        rest, _ = await asyncio.wait_for(read_to_end(reader), TIMEOUT)
        await hang_up(writer)
        assert rest == fatal[:137]
        assert (proxy.stats.cuts, proxy.stats.mid_frame_cuts) == (1, 1)


# -- cut_fraction ---------------------------------------------------------------------------------


async def test_cut_fraction_cuts_about_that_share_and_the_seed_repeats_the_run() -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            await reader.readline()
            writer.write(b"ok")
            await writer.drain()
        writer.close()

    async def run(url: str, seed: int) -> list[bool]:
        cut: list[bool] = []
        async with FaultProxy(url, seed=seed) as proxy:
            proxy.cut_fraction(0.3)
            for _ in range(200):  # one after the other: the order of the draws is fixed
                reader, writer = await connect(proxy)
                writer.write(b"go\n")
                received, _ = await asyncio.wait_for(read_to_end(reader), TIMEOUT)
                await hang_up(writer)
                assert received in (b"", b"ok")
                cut.append(received == b"")
            assert proxy.stats.cuts == sum(cut)
            assert proxy.stats.accepted == 200
        return cut

    async with tcp_server(answer) as url:
        first, again, other = await run(url, 7), await run(url, 7), await run(url, 8)
    assert 40 <= sum(first) <= 80  # 0.3 of 200, give or take
    assert first == again
    assert first != other


# -- delay ----------------------------------------------------------------------------------------


async def test_delay_holds_each_server_chunk_and_keeps_the_order(recorder_url: str) -> None:
    async with FaultProxy(recorder_url) as proxy, aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{proxy.url}/ws") as ws:
            proxy.delay = 0.05
            started = time.monotonic()
            for i in range(4):  # a round trip per chunk: each one is held
                await ws.send_str(f"ping{i}")
                assert await asyncio.wait_for(ws.receive_str(), TIMEOUT) == f"ping{i}"
            assert time.monotonic() - started >= 4 * 0.05
            proxy.delay = 0.002
            await ws.send_str("burst:300")
            got = [await asyncio.wait_for(ws.receive_str(), TIMEOUT) for _ in range(300)]
            assert got == [str(i) for i in range(300)]
        assert proxy.stats.cuts == 0


# -- refuse and drop_all --------------------------------------------------------------------------


async def test_refuse_aborts_new_connections_and_spares_open_ones(
    recorder_url: str, recorder: Recorder
) -> None:
    async with FaultProxy(recorder_url) as proxy, aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{proxy.url}/ws") as ws:
            proxy.refuse = True
            reader, writer = await connect(proxy)
            writer.write(b"GET /ws HTTP/1.1\r\nHost: x\r\n\r\n")
            received, _ = await asyncio.wait_for(read_to_end(reader), TIMEOUT)
            await hang_up(writer)
            assert received == b""
            with pytest.raises(aiohttp.ClientConnectionError):
                await session.post(f"{proxy.url}/commit", data=b"never")
            assert proxy.stats.refused == 2
            assert recorder.bodies == []  # the refused ones never reached the server
            await ws.send_str("still here")
            assert await asyncio.wait_for(ws.receive_str(), TIMEOUT) == "still here"
            proxy.refuse = False
            async with session.post(f"{proxy.url}/commit", data=b"back") as response:
                assert response.status == 200
        assert recorder.sockets == 1
        assert proxy.stats.accepted == 2


async def test_drop_all_counts_and_cuts_open_links_and_both_ends_see_it() -> None:
    server_saw_end: asyncio.Queue[bytes] = asyncio.Queue()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received, _ = await read_to_end(reader)
        server_saw_end.put_nowait(received)
        writer.close()

    async with tcp_server(hold) as url, FaultProxy(url) as proxy:
        links = [await connect(proxy) for _ in range(3)]
        for i, (_, writer) in enumerate(links):
            writer.write(b"%d" % i)
        await asyncio.wait_for(proxy.wait_until(lambda s: s.open == 3), TIMEOUT)
        assert proxy.drop_all() == 3
        assert proxy.stats.dropped == 3
        for reader, writer in links:
            received, _ = await asyncio.wait_for(read_to_end(reader), TIMEOUT)
            assert received == b""
            await hang_up(writer)
        await asyncio.wait_for(proxy.wait_until(settled), TIMEOUT)
        assert proxy.drop_all() == 0
        assert proxy.stats.dropped == 3
        async with asyncio.timeout(TIMEOUT):  # the server's side of each link ended too
            ends = [await server_saw_end.get() for _ in range(3)]
    assert sorted(ends) == [b"0", b"1", b"2"]


# -- websockets -----------------------------------------------------------------------------------


async def test_websocket_frames_flow_both_ways_and_the_cut_lands_on_the_nth_server_chunk(
    recorder_url: str, recorder: Recorder
) -> None:
    async with FaultProxy(recorder_url) as proxy, aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{proxy.url}/ws") as ws:  # many frames each way
            for i in range(200):
                await ws.send_str(f"up{i}")
            got = [await asyncio.wait_for(ws.receive_str(), TIMEOUT) for _ in range(200)]
            assert got == [f"up{i}" for i in range(200)]
            await ws.send_str("burst:500")
            got = [await asyncio.wait_for(ws.receive_str(), TIMEOUT) for _ in range(500)]
            assert got == [str(i) for i in range(500)]
        assert proxy.stats.cuts == 0

        recorder.messages.clear()
        proxy.cut_next(1, skip_chunks=1 + 5)  # the 101, five echoes, then the sixth is lost
        async with session.ws_connect(f"{proxy.url}/ws") as ws:
            for i in range(5):  # one round trip at a time: one echo, one chunk
                await ws.send_str(f"m{i}")
                assert await asyncio.wait_for(ws.receive_str(), TIMEOUT) == f"m{i}"
            await ws.send_str("m5")
            msg = await asyncio.wait_for(ws.receive(), TIMEOUT)
            assert msg.type in (WSMsgType.CLOSED, WSMsgType.CLOSE, WSMsgType.ERROR)
        assert recorder.messages == [f"m{i}" for i in range(6)]  # the sixth reached the server
        assert proxy.stats.cuts == 1


# -- half-close and big transfers -----------------------------------------------------------------


async def test_megabytes_both_ways_at_once_arrive_intact_and_a_client_half_close_passes() -> None:
    download = random.Random(2).randbytes(6 * 1024 * 1024)
    upload = random.Random(3).randbytes(6 * 1024 * 1024)

    async def swap(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def send() -> None:
            writer.write(download)
            await writer.drain()

        sending = asyncio.ensure_future(send())
        received, _ = await read_to_end(reader)  # ends only if the client's EOF is passed on
        await sending
        writer.write(hashlib.sha256(received).digest())
        await writer.drain()
        writer.close()

    async with tcp_server(swap) as url, FaultProxy(url) as proxy:
        reader, writer = await connect(proxy)

        async def send() -> None:
            writer.write(upload)
            await writer.drain()
            writer.write_eof()

        sending = asyncio.ensure_future(send())
        received, reset = await asyncio.wait_for(read_to_end(reader), TIMEOUT)
        await sending
        await hang_up(writer)
        assert not reset
        assert hashlib.sha256(received[:-32]).digest() == hashlib.sha256(download).digest()
        assert received[-32:] == hashlib.sha256(upload).digest()
        await asyncio.wait_for(proxy.wait_until(settled), TIMEOUT)


async def test_a_server_half_close_is_passed_on_and_the_client_can_still_send() -> None:
    server_got: list[bytes] = []

    async def announce_then_listen(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(b"hello")
        writer.write_eof()  # done talking, still listening
        received, _ = await read_to_end(reader)
        server_got.append(received)
        writer.close()

    async with tcp_server(announce_then_listen) as url, FaultProxy(url) as proxy:
        reader, writer = await connect(proxy)
        assert await asyncio.wait_for(reader.read(), TIMEOUT) == b"hello"
        writer.write(b"world")
        writer.write_eof()
        await asyncio.wait_for(proxy.wait_until(settled), TIMEOUT)
        await hang_up(writer)
    assert server_got == [b"world"]


# -- many connections, clean close ----------------------------------------------------------------


async def test_hundreds_of_concurrent_links_echo_and_close_leaves_nothing_behind() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received, _ = await read_to_end(reader)
        writer.write(received)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    before = asyncio.all_tasks()
    async with tcp_server(echo) as url:
        proxy = await FaultProxy(url).start()

        async def one(i: int) -> bytes:
            reader, writer = await connect(proxy)
            writer.write(b"%d:" % i + bytes([i % 256]) * 10_000)
            writer.write_eof()
            received, _ = await read_to_end(reader)
            await hang_up(writer)
            return received

        answers = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(300))), TIMEOUT)
        assert answers == [b"%d:" % i + bytes([i % 256]) * 10_000 for i in range(300)]
        await asyncio.wait_for(proxy.wait_until(settled), TIMEOUT)
        assert proxy.stats.accepted == 300
        await proxy.close()
    assert asyncio.all_tasks() - before == set()


async def test_close_ends_every_accepted_connection_even_those_still_being_set_up() -> None:
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_to_end(reader)
        writer.close()

    before = asyncio.all_tasks()
    async with tcp_server(hold) as url:
        proxy = await FaultProxy(url).start()
        links = await asyncio.gather(*(connect(proxy) for _ in range(200)))
        await proxy.close()  # some links are still connecting to the server at this point
        assert proxy.stats.open == 0
        for reader, writer in links:
            received, _ = await asyncio.wait_for(read_to_end(reader), TIMEOUT)
            assert received == b""  # every client hears the proxy go, none is left hanging
            await hang_up(writer)
    assert asyncio.all_tasks() - before == set()


# -- restart_client -------------------------------------------------------------------------------


async def test_restart_client_keeps_the_apps_op_id_minter_and_replays_first(
    server_url: str, token: str, tmp_path: Path
) -> None:
    minted = (f"app_{n:04d}" for n in itertools.count(1))
    config = fast_config(ops_over_websocket=False, retry_attempts=1)
    async with FaultProxy(server_url) as proxy:
        proxy.refuse = True
        client = WorkspaceClient(
            proxy.url,
            token=token,
            outbox=tmp_path / "outbox",
            config=config,
            new_op_id=lambda: next(minted),
        )
        await client.start()
        with pytest.raises(StillPendingError):
            await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        proxy.refuse = False
        fresh = await restart_client(client)
        try:
            commit = await asyncio.wait_for(
                fresh.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c")), TIMEOUT
            )
        finally:
            await fresh.close()
    assert commit.op_id == "app_0002"  # the app's minter, not a fresh default one
    log = await server_log(server_url, "tree")
    assert [entry["op_id"] for entry in log] == ["app_0001", "app_0002"]
