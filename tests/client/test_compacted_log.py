"""The SDK behind the horizon (docs/client.md, "Behind the horizon"), through the real server
after it compacted its log: `subscribe()` yields a `Snapshot` then the ops after it, the HTTP
catch-up reads the state on 410, a direct `read_ops` raises `LogCompactedError`, and a `LiveDoc`
with pending ops resets to the snapshot and keeps them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from cv_mutations import NodeIncrement, NodeInsert, SubDocState, apply_op
from cv_server import ServerConfig, create_app
from cv_server.compaction import compact_once
from cv_server.keys import CONFIG, STORES
from cv_workspace_client import (
    Committed,
    LogCompactedError,
    Snapshot,
    StillPendingError,
    WorkspaceClient,
)

from .conftest import ServerFactory
from .helpers import SECRET, WS, fast_config, token_for
from .live_helpers import BOUND, count_of, offline_view, settled


@pytest.fixture
async def server(aiohttp_server: ServerFactory, tmp_path: Path) -> TestServer:
    """The client tests' server, with a snapshot every 5 ops, so compaction has ops to take."""
    config = ServerConfig(db_path=tmp_path / "server.db", token_secret=SECRET, snapshot_every=5)
    return await aiohttp_server(create_app(config))


async def compact(server: TestServer) -> int:
    """One compaction pass as if every op were past the retention; the ops it deleted."""
    config = server.app[CONFIG]
    later = time.time() + config.oplog_retention_seconds + 60
    return (await compact_once(server.app[STORES], config, now=lambda: later)).ops


async def written(client: WorkspaceClient, increments: int) -> None:
    await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
    for _ in range(increments):  # one at a time: a snapshot at each multiple of 5
        await client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))


async def test_subscribe_behind_the_horizon_yields_a_snapshot_then_the_ops_after_it(
    server: TestServer, server_url: str
) -> None:
    async with WorkspaceClient(server_url, token=token_for(WS), config=fast_config()) as client:
        await written(client, 11)  # clocks 1..12, snapshot at 10
        assert await compact(server) == 9
        events: list[Committed | Snapshot] = []
        async with client.subscribe(WS, "tree", since=0) as sub:
            events.append(await asyncio.wait_for(anext(sub), BOUND))
            await client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c", by=5))
            events.append(await asyncio.wait_for(anext(sub), BOUND))
        first, then = events
        assert isinstance(first, Snapshot)
        assert first.clock == 12
        assert count_of(first.state) == 11
        assert isinstance(then, Committed)
        assert then.clock == 13
        state = first.state
        apply_op(state, then.op)
        clock, truth = await client.get_state(WS, "tree")
        assert (then.clock, state.to_json()) == (clock, truth.to_json())


async def test_the_http_catch_up_behind_the_horizon_reads_the_state(
    server: TestServer, server_url: str
) -> None:
    async with WorkspaceClient(server_url, token=token_for(WS), config=fast_config()) as client:
        await written(client, 11)
        await compact(server)
        with pytest.raises(LogCompactedError) as raised:
            await client.read_ops(WS, "tree", since=0)
        assert (raised.value.horizon, raised.value.clock) == (10, 12)
        assert raised.value.state_url == "/v1/workspaces/ws1/docs/tree"
        head, entries = await client.read_log(WS, "tree", 0, 100)
        assert head == 12
        (snapshot,) = entries
        assert isinstance(snapshot, Snapshot)
        assert (snapshot.clock, count_of(snapshot.state)) == (12, 11)


async def test_a_live_doc_with_pending_ops_resets_to_a_snapshot_and_keeps_them(
    server: TestServer, server_url: str
) -> None:
    async with offline_view(server_url) as net:  # the view at clock 1, offline
        doc = net.doc
        for _ in range(3):
            with pytest.raises(StillPendingError):
                await asyncio.wait_for(doc.apply_op(NodeIncrement(node_id="n", field="c")), BOUND)
        assert count_of(doc.state) == 3
        for _ in range(11):  # meanwhile: clocks 2..12, then compacted below 10
            await net.theirs.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c", by=10))
        assert await compact(server) == 9
        net.back_online()
        truth = await settled(doc, server_url)
        assert doc.error is None
        assert doc.state.to_json() == truth["state"]
        assert count_of(doc.state) == 113  # 11 x 10 from them, 3 pending ops of ours, each once
        assert SubDocState.from_json(truth["state"]).nodes["n"].fields["c"] == 113
