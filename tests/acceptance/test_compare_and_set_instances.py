"""Acceptance: compare-and-set across two real `cv-server` processes on one PostgreSQL database
(docs/ops.md#conflicts). Two SDK clients, each on its own instance, race read-modify-write
increments of one cell: no increment is lost. The same race with plain writes loses one, so the
test shows what `if_clock` buys.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cv_mutations import NodeInsert, NodeUpdate, SubDocState
from cv_server.cli import _with_schema
from cv_workspace_client import (
    ClientConfig,
    ConflictRetryPolicy,
    VersionConflictError,
    WorkspaceClient,
)
from tests.acceptance.procs import ServerProcess, free_port, mint_cli_token
from tests.pg.helpers import fresh_schema

pytestmark = [pytest.mark.acceptance, pytest.mark.postgres]

WS = "acc"
DOC = "cell"
#: Read-modify-writes per client (bounded), and the bound on every wait.
ROUNDS = 20
DEADLINE_S = 90.0


@pytest.fixture
async def instances(postgres_url: str, tmp_path: Path) -> AsyncIterator[tuple[list[str], str]]:
    async with fresh_schema(postgres_url) as schema:
        url = _with_schema(postgres_url, schema)
        servers = [
            ServerProcess(None, free_port(), tmp_path / f"server{i}.log", database_url=url)
            for i in range(2)
        ]
        try:
            await asyncio.gather(*(asyncio.to_thread(server.start) for server in servers))
            token = await asyncio.to_thread(mint_cli_token, None, WS, database_url=url)
            yield [server.url for server in servers], token
        finally:
            for server in servers:
                await asyncio.to_thread(server.stop)


def count_of(state: SubDocState) -> int:
    value = state.nodes["c"].fields.get("count", 0)
    assert isinstance(value, int)
    return value


def plus_one(state: SubDocState) -> list[NodeUpdate]:
    return [NodeUpdate(node_id="c", set={"count": count_of(state) + 1})]


async def test_racing_read_modify_writes_on_two_instances_lose_no_increment(
    instances: tuple[list[str], str],
) -> None:
    urls, token = instances
    config = ClientConfig(
        retry_base_seconds=0.01,
        conflict_retry=ConflictRetryPolicy(backoffs=(0.001, 0.002, 0.004, 0.008)),
    )
    a = WorkspaceClient(urls[0], token=token, config=config)
    b = WorkspaceClient(urls[1], token=token, config=config)
    await a.start()
    await b.start()
    try:
        await a.apply_op(WS, DOC, NodeInsert(node_id="c", parent_id="root"))
        both_read = asyncio.Barrier(2)

        async def plain(client: WorkspaceClient) -> None:
            _, state = await client.get_state(WS, DOC)
            await both_read.wait()
            await client.apply_op(WS, DOC, plus_one(state)[0])

        await asyncio.wait_for(asyncio.gather(plain(a), plain(b)), timeout=DEADLINE_S)
        _, state = await a.get_state(WS, DOC)
        assert count_of(state) == 1  # two plain increments succeeded: one was lost

        async def run(client: WorkspaceClient) -> int:
            done = 0
            for _ in range(ROUNDS):
                try:
                    await client.read_modify_write(WS, DOC, plus_one)
                except VersionConflictError:
                    continue  # retries spent: nothing applied
                done += 1
            return done

        done = await asyncio.wait_for(asyncio.gather(run(a), run(b)), timeout=DEADLINE_S)
        _, state = await b.get_state(WS, DOC)
        assert count_of(state) == 1 + sum(done)
        assert sum(done) >= ROUNDS
    finally:
        await a.close()
        await b.close()
