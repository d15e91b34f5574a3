"""Through the real server and the fault proxy: answers lost after the commit, and subscribers cut
again and again. Bounded in count (4,000 and 5,000 ops) and in time (TIMEOUT)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from cv_mutations import NodeIncrement, NodeInsert
from cv_workspace_client import StillPendingError, Subscription, WorkspaceClient
from cv_workspace_client.testing import FaultProxy

from .helpers import WS, fast_config, server_log, server_state

TIMEOUT = 240
CLIENTS = 8
OPS_PER_CLIENT = 500


async def write_one_by_one(client: WorkspaceClient, count: int) -> int:
    """Each op awaits its answer before the next is sent. Returns how many gave up (they stay in
    the outbox, and are replayed ahead of the next op: nothing to do but carry on)."""
    still_pending = 0
    for _ in range(count):
        try:
            await client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
        except StillPendingError:
            still_pending += 1
    await client.wait_synced(timeout=TIMEOUT)
    return still_pending


async def test_eight_clients_with_a_fifth_of_connections_cut_after_commit_apply_each_op_once(
    server_url: str, token: str, tmp_path: Path
) -> None:
    async with (
        FaultProxy(server_url, seed=1) as http_proxy,
        FaultProxy(server_url, seed=2) as socket_proxy,
    ):
        # Every answer chunk the server sends is lost with this probability, connection and all:
        # the server has committed, the client never hears it, and must retry under the op_id.
        http_proxy.cut_chunks(0.25)
        socket_proxy.cut_chunks(0.25, skip_chunks=1)  # chunk 1 is the websocket handshake
        clients = [
            WorkspaceClient(
                (socket_proxy if n % 2 else http_proxy).url,
                token=token,
                outbox=tmp_path / f"client{n}.outbox" if n < CLIENTS // 2 else None,
                config=fast_config(ops_over_websocket=bool(n % 2)),
            )
            for n in range(CLIENTS)
        ]
        for client in clients:
            await client.start()
        try:
            await clients[0].apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
            async with asyncio.timeout(TIMEOUT):
                await asyncio.gather(*(write_one_by_one(c, OPS_PER_CLIENT) for c in clients))
        finally:
            for client in clients:
                await client.close()
        stats = [http_proxy.stats, socket_proxy.stats]
    accepted = sum(s.accepted for s in stats)
    cuts = sum(s.cuts for s in stats)
    assert cuts >= 0.2 * accepted, stats
    assert cuts >= 100
    state = await server_state(server_url, "tree")
    assert state["state"]["nodes"]["n"]["fields"]["c"] == CLIENTS * OPS_PER_CLIENT
    log = await server_log(server_url, "tree")
    assert len(log) == 1 + CLIENTS * OPS_PER_CLIENT
    assert len({entry["op_id"] for entry in log}) == len(log)


async def read_clocks(sub: Subscription, last: int) -> list[int]:
    clocks: list[int] = []
    async for committed in sub:
        clocks.append(committed.clock)
        if committed.clock >= last:
            return clocks
    return clocks


async def test_a_subscriber_cut_repeatedly_during_5000_commits_sees_every_clock_once_in_order(
    server_url: str, token: str
) -> None:
    commits, window = 5000, 100
    async with (
        FaultProxy(server_url, seed=3) as proxy,
        WorkspaceClient(server_url, token=token, config=fast_config()) as writer,
        WorkspaceClient(proxy.url, token=token, config=fast_config()) as reader,
    ):
        await writer.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        proxy.cut_chunks(0.01, skip_chunks=1)  # and now and then, at random, a live frame
        async with reader.subscribe(WS, "tree") as sub:
            seen = asyncio.create_task(read_clocks(sub, commits + 1))
            async with asyncio.timeout(TIMEOUT):
                for done in range(0, commits, window):
                    await asyncio.gather(
                        *(
                            writer.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
                            for _ in range(window)
                        )
                    )
                    if done % 500 == 0:
                        # A fault landing while the reader is between connections (still
                        # reconnecting after the last one) hits nothing, and the counts below
                        # (10 faults, `>= 10`: no margin) come out short. Wait for its socket.
                        await reader.connect(WS, timeout=TIMEOUT)
                        # Alternately: kill the connection, or tear the next frame in half.
                        if done % 1000:
                            proxy.cut_open(forward_bytes=5)
                        else:
                            proxy.drop_all()
                clocks = await seen
        connections = reader._sockets[WS].connections
    assert clocks == list(range(1, commits + 2))
    assert proxy.stats.cuts + proxy.stats.dropped >= 10
    assert connections >= 10  # it really was cut and resumed, again and again
