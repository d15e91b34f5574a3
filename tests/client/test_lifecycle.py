"""The client's life cycle across workspaces, through the real server on loopback: connect and
close against refused tokens, closing under subscriptions that still had to catch up, one socket
per workspace cut or refused alone, upgrades never answered, reconnect backoff, and hundreds of
subscriptions resubscribed after a cut."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from cv_mutations import NodeIncrement, NodeInsert
from cv_workspace_client import ForbiddenError, Subscription, WorkspaceClient, WorkspaceError
from cv_workspace_client.testing import FaultProxy

from .helpers import WS, RecordingSleep, collect, fast_config, token_for

TIMEOUT = 30
OTHER = "ws2"


async def drain(sub: Subscription) -> list[int]:
    return [committed.clock async for committed in sub]


async def seed(client: WorkspaceClient, workspace: str, sub_doc: str, increments: int) -> None:
    await client.apply_op(workspace, sub_doc, NodeInsert(node_id="n", parent_id="root"))
    await asyncio.gather(
        *(
            client.apply_op(workspace, sub_doc, NodeIncrement(node_id="n", field="c"))
            for _ in range(increments)
        )
    )


def other_tasks() -> set[asyncio.Task[object]]:
    current = asyncio.current_task()
    return {task for task in asyncio.all_tasks() if task is not current and not task.done()}


@contextlib.asynccontextmanager
async def silent_server() -> AsyncIterator[tuple[str, list[int]]]:
    """A TCP server that accepts and reads, and never answers (an upgrade left hanging)."""
    accepted: list[int] = []
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        writers.append(writer)
        with contextlib.suppress(Exception):
            while await reader.read(65536):
                pass

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


# -- connect and auth -----------------------------------------------------------------------------


async def test_connect_after_the_token_was_refused_raises_it_instead_of_waiting_forever(
    server_url: str,
) -> None:
    async with WorkspaceClient(
        server_url, token=token_for("other"), config=fast_config()
    ) as client:
        with pytest.raises(ForbiddenError):
            await asyncio.wait_for(anext(aiter(client.subscribe(WS, "tree"))), TIMEOUT)
        # The socket gave up for good; `connect` raises rather than wait for an open that never
        # comes.
        with pytest.raises(ForbiddenError):
            await client.connect(WS, timeout=TIMEOUT)


async def test_a_token_for_one_workspace_fails_the_others_subscription_alone_without_retrying(
    server_url: str,
) -> None:
    async with (
        FaultProxy(server_url) as proxy,
        WorkspaceClient(server_url, token=token_for(WS), config=fast_config()) as writer,
        WorkspaceClient(proxy.url, token=token_for(WS), config=fast_config()) as client,
    ):
        await seed(writer, WS, "tree", 4)
        async with (
            client.subscribe(WS, "tree") as allowed,
            client.subscribe(OTHER, "tree") as refused,
        ):
            flowing = asyncio.create_task(collect(allowed, 15))
            with pytest.raises(ForbiddenError):
                await asyncio.wait_for(anext(refused), TIMEOUT)
            accepted = proxy.stats.accepted
            await seed(writer, WS, "other", 0)  # more traffic, then more ops for `allowed`
            await asyncio.gather(
                *(
                    writer.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
                    for _ in range(10)
                )
            )
            assert await asyncio.wait_for(flowing, TIMEOUT) == list(range(1, 16))
            # The refused workspace's socket connected once and stopped: no reconnect storm.
            assert proxy.stats.accepted == accepted
            assert client._sockets[OTHER].connections == 1
            assert client._sockets[WS].connections == 1


# -- close ----------------------------------------------------------------------------------------


async def test_closing_the_client_ends_a_subscription_that_still_had_to_catch_up(
    server_url: str, token: str
) -> None:
    client = WorkspaceClient(server_url, token=token, config=fast_config(catchup_page=5))
    await client.start()
    await seed(client, WS, "tree", 29)
    async with client.subscribe(WS, "tree") as first, client.subscribe(WS, "tree") as second:
        # The second subscription of a sub-doc catches up from the log, a page at a time.
        assert (await anext(second)).clock == 1
        await client.close()
        # The subscription ends; it does not raise the client's RuntimeError (its session gone).
        leftover = await asyncio.wait_for(drain(second), TIMEOUT)
        assert leftover == list(range(2, 2 + len(leftover)))
        buffered = await asyncio.wait_for(drain(first), TIMEOUT)
        assert buffered == list(range(1, 1 + len(buffered)))  # what it held, then the end


async def test_closing_the_client_ends_a_subscription_waiting_out_a_read_retry_at_once(
    server_url: str, token: str
) -> None:
    async with FaultProxy(server_url) as proxy:
        # A read retry waits 30 s: the iteration must end when the client closes, not after it.
        client = WorkspaceClient(proxy.url, token=token, config=fast_config(backoff=lambda n: 30.0))
        await client.start()
        await seed(client, WS, "tree", 3)
        first = client.subscribe(WS, "tree")
        second = client.subscribe(WS, "tree")
        await first.__aenter__()
        await second.__aenter__()
        proxy.refuse = True
        proxy.drop_all()
        reader = asyncio.create_task(drain(second))
        await asyncio.wait_for(proxy.wait_until(lambda s: s.refused >= 1), TIMEOUT)
        before = other_tasks()
        await asyncio.wait_for(client.close(), 5)
        assert await asyncio.wait_for(reader, 5) == []
        assert await asyncio.wait_for(drain(first), 5) == []
        # Nothing the client started outlives it (the socket's reconnect sleep included).
        await asyncio.sleep(0)
        leaked = {t for t in other_tasks() & before if "cv-socket" in t.get_name()}
        assert not leaked


# -- sockets across workspaces --------------------------------------------------------------------


async def test_a_socket_cut_in_one_workspace_resumes_gap_free_while_the_other_keeps_flowing(
    server_url: str,
) -> None:
    token = token_for(WS, OTHER)
    async with (
        FaultProxy(server_url) as proxy,
        WorkspaceClient(server_url, token=token, config=fast_config()) as writer,
        WorkspaceClient(proxy.url, token=token, config=fast_config()) as client,
    ):
        await seed(writer, WS, "tree", 0)
        await seed(writer, OTHER, "tree", 0)
        async with client.subscribe(WS, "tree") as cut:
            assert (await asyncio.wait_for(anext(cut), TIMEOUT)).clock == 1
            assert proxy.cut_open() == 1  # only WS's socket is open: arm it alone
            async with client.subscribe(OTHER, "tree") as kept:
                await client.connect(OTHER, timeout=TIMEOUT)
                cut_seen = asyncio.create_task(collect(cut, 101))
                kept_seen = asyncio.create_task(collect(kept, 101))
                for _ in range(4):
                    await asyncio.gather(
                        *(
                            writer.apply_op(ws, "tree", NodeIncrement(node_id="n", field="c"))
                            for ws in (WS, OTHER)
                            for _ in range(25)
                        )
                    )
                assert await asyncio.wait_for(cut_seen, TIMEOUT) == list(range(2, 102))
                assert await asyncio.wait_for(kept_seen, TIMEOUT) == list(range(1, 102))
        assert proxy.stats.cuts == 1
        assert client._sockets[WS].connections == 2
        assert client._sockets[OTHER].connections == 1


async def test_five_hundred_subscriptions_on_one_socket_are_all_resubscribed_after_a_cut(
    server_url: str, token: str
) -> None:
    sub_docs = [f"doc{i}" for i in range(500)]
    async with (
        FaultProxy(server_url) as proxy,
        WorkspaceClient(server_url, token=token, config=fast_config()) as writer,
        WorkspaceClient(proxy.url, token=token, config=fast_config()) as client,
        contextlib.AsyncExitStack() as stack,
    ):
        subs = [await stack.enter_async_context(client.subscribe(WS, d)) for d in sub_docs]
        await client.connect(WS, timeout=TIMEOUT)
        await asyncio.gather(
            *(writer.apply_op(WS, d, NodeInsert(node_id="n", parent_id="root")) for d in sub_docs)
        )
        firsts = await asyncio.wait_for(asyncio.gather(*(anext(s) for s in subs)), TIMEOUT)
        assert [c.clock for c in firsts] == [1] * 500
        proxy.drop_all()
        await asyncio.gather(
            *(writer.apply_op(WS, d, NodeIncrement(node_id="n", field="c")) for d in sub_docs)
        )
        seconds = await asyncio.wait_for(asyncio.gather(*(anext(s) for s in subs)), TIMEOUT)
        assert [c.clock for c in seconds] == [2] * 500
        assert client._sockets[WS].connections == 2


# -- connecting to a server that does not answer or refuses ---------------------------------------


async def test_a_websocket_upgrade_never_answered_is_bounded_by_the_request_timeout() -> None:
    async with silent_server() as (url, accepted):
        config = fast_config(request_timeout_seconds=0.2)
        async with WorkspaceClient(url, token="t", config=config) as client:
            with pytest.raises(TimeoutError):
                await client.connect(WS, timeout=1.0)
            # Each hanging upgrade is given up after the request timeout and tried again: a
            # second one comes (a state, polled: however few fit in that second on this machine).
            async with asyncio.timeout(10):
                while len(accepted) < 2:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
        assert len(accepted) <= 1.0 / 0.2 + 2


async def test_reconnects_to_a_refusing_server_back_off_with_a_growing_attempt_number() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    failures_seen: list[int] = []
    gate = asyncio.Event()

    def backoff(failures: int) -> float:
        failures_seen.append(failures)
        if len(failures_seen) >= 8:
            gate.set()
        return 0.001

    config = fast_config(backoff=backoff)
    async with WorkspaceClient(f"http://127.0.0.1:{port}", token="t", config=config) as client:
        client.subscribe(WS, "tree")._register()
        await asyncio.wait_for(gate.wait(), TIMEOUT)
    # Connection refused again and again: the delay grows with each failure (full jitter over
    # base * 2^n), it is never reset to the first step.
    assert failures_seen[:8] == list(range(1, 9))


async def test_a_server_closing_with_1011_after_answering_is_not_reconnected_to_in_a_tight_loop(
    aiohttp_server: Any,
) -> None:
    """A connection that carried frames proves the server is up, so the SDK reconnects at once;
    but one the server then ends with 1011 (an internal error: a subscription that fails on
    every catch-up, say) proves the opposite, and must back off like a failed connect."""
    connections = 0
    calm = asyncio.Event()

    async def socket_route(request: web.Request) -> web.WebSocketResponse:
        nonlocal connections
        connections += 1
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        frame = await ws.receive_json(timeout=10)
        await ws.send_json({"type": "synced", "sub_doc": frame["sub_doc"], "clock": 0})
        if connections < 6:
            await ws.close(code=1011, message=b"subscription failed; reconnect")
        else:  # from the sixth connection on, the server behaves: the client stays
            calm.set()
            async for _ in ws:
                pass
        return ws

    app = web.Application()
    app.router.add_get("/v1/workspaces/{ws}/socket", socket_route)
    server = await aiohttp_server(app)
    sleep = RecordingSleep()
    url = str(server.make_url("")).rstrip("/")
    async with WorkspaceClient(url, token=token_for(WS), config=fast_config(sleep=sleep)) as client:
        sub = client.subscribe(WS, "tree")
        reader = asyncio.create_task(drain(sub))
        await asyncio.wait_for(calm.wait(), TIMEOUT)
        await sub.aclose()
        await asyncio.wait_for(reader, TIMEOUT)
    # One backoff wait before each of the five reconnects that followed a 1011.
    assert len(sleep.delays) >= 5, sleep.delays


@pytest.mark.parametrize("status", [400, 404])
async def test_an_upgrade_refused_with_a_4xx_fails_the_subscription_instead_of_retrying_forever(
    aiohttp_server: Any, status: int
) -> None:
    attempts = 0

    async def refuse(request: web.Request) -> web.Response:
        nonlocal attempts
        attempts += 1
        return web.Response(status=status, text="no websockets here")

    app = web.Application()
    app.router.add_get("/v1/workspaces/{ws}/socket", refuse)
    server = await aiohttp_server(app)
    sleep = RecordingSleep()
    url = str(server.make_url("")).rstrip("/")
    config = fast_config(sleep=sleep)
    async with (
        WorkspaceClient(url, token=token_for(WS), config=config) as client,
        client.subscribe(WS, "tree") as sub,
    ):
        with pytest.raises(WorkspaceError) as caught:
            await asyncio.wait_for(drain(sub), TIMEOUT)
    assert not caught.value.retryable
    assert attempts == 1
    assert sleep.delays == []
