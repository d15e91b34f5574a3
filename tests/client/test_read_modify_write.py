"""Read-modify-write with real SDK clients racing on one cell through a real server on loopback
(docs/ops.md#conflicts): without `if_clock` the second write silently overwrites the first;
with it (`read_modify_write`) no increment is lost. On SQLite, on PostgreSQL, and with the two
clients on two server instances sharing one PostgreSQL database.

Both clients read before either writes (a barrier), so the lost update is certain, not timing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from cv_mutations import NodeInsert, NodeUpdate, SubDocState
from cv_server import ServerConfig, create_app
from cv_server.cli import _with_schema
from cv_workspace_client import (
    ConflictRetryPolicy,
    VersionConflictError,
    WorkspaceClient,
)
from tests.pg.helpers import fresh_schema

from .helpers import SECRET, WS, RecordingSleep, fast_config, token_for

ServerFactory = Callable[..., Awaitable[TestServer]]
DOC = "cell"
#: Each client's read-modify-writes in the concurrent run (bounded).
ROUNDS = 15
#: Short waits between tries, so the bounded retries are exercised quickly.
POLICY = ConflictRetryPolicy(backoffs=(0.001, 0.002, 0.004))


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("postgres-two-instances", marks=pytest.mark.postgres),
    ]
)
async def urls(
    request: pytest.FixtureRequest, aiohttp_server: ServerFactory, tmp_path: Path
) -> AsyncIterator[tuple[str, str]]:
    """The URLs the two clients talk to: one server, or two instances on one database."""

    def url(server: TestServer) -> str:
        return str(server.make_url("")).rstrip("/")

    if request.param == "sqlite":
        config = ServerConfig(db_path=tmp_path / "server.db", token_secret=SECRET)
        server = await aiohttp_server(create_app(config))
        yield url(server), url(server)
        return
    postgres_url: str = request.getfixturevalue("postgres_url")
    async with fresh_schema(postgres_url) as schema:
        database_url = _with_schema(postgres_url, schema)
        count = 2 if request.param == "postgres-two-instances" else 1
        servers = [
            await aiohttp_server(
                create_app(ServerConfig(database_url=database_url, token_secret=SECRET))
            )
            for _ in range(count)
        ]
        yield url(servers[0]), url(servers[-1])
        for server in servers:
            await server.close()


async def clients(urls: tuple[str, str]) -> list[WorkspaceClient]:
    opened = []
    for url in urls:
        client = WorkspaceClient(
            url, token=token_for(WS), config=fast_config(conflict_retry=POLICY)
        )
        await client.start()
        opened.append(client)
    return opened


def count_of(state: SubDocState) -> int:
    value = state.nodes["c"].fields.get("count", 0)
    assert isinstance(value, int)
    return value


def plus_one(state: SubDocState) -> list[NodeUpdate]:
    return [NodeUpdate(node_id="c", set={"count": count_of(state) + 1})]


async def test_without_if_clock_the_second_write_silently_overwrites_the_first(
    urls: tuple[str, str],
) -> None:
    a, b = await clients(urls)
    try:
        await a.apply_op(WS, DOC, NodeInsert(node_id="c", parent_id="root"))
        both_read = asyncio.Barrier(2)

        async def increment(client: WorkspaceClient) -> None:
            _, state = await client.get_state(WS, DOC)
            await both_read.wait()
            await client.apply_op(WS, DOC, plus_one(state)[0])

        await asyncio.wait_for(asyncio.gather(increment(a), increment(b)), timeout=30)
        _, state = await a.get_state(WS, DOC)
        assert count_of(state) == 1  # two increments succeeded; one is lost
    finally:
        await a.close()
        await b.close()


async def test_with_if_clock_the_loser_gets_a_conflict_with_the_head_and_nothing_applied(
    urls: tuple[str, str],
) -> None:
    a, b = await clients(urls)
    try:
        await a.apply_op(WS, DOC, NodeInsert(node_id="c", parent_id="root"))
        both_read = asyncio.Barrier(2)

        async def increment(client: WorkspaceClient) -> int:
            clock, state = await client.get_state(WS, DOC)
            await both_read.wait()
            await client.apply_op(WS, DOC, plus_one(state)[0], if_clock=clock)
            return clock

        answers = await asyncio.wait_for(
            asyncio.gather(increment(a), increment(b), return_exceptions=True), timeout=30
        )
        conflicts = [x for x in answers if isinstance(x, VersionConflictError)]
        assert len(conflicts) == 1, answers
        assert conflicts[0].clock == 2
        clock, state = await a.get_state(WS, DOC)
        assert (clock, count_of(state)) == (2, 1)
    finally:
        await a.close()
        await b.close()


async def test_read_modify_write_racing_loses_no_increment(urls: tuple[str, str]) -> None:
    a, b = await clients(urls)
    try:
        await a.apply_op(WS, DOC, NodeInsert(node_id="c", parent_id="root"))
        first_reads = asyncio.Barrier(2)
        conflicts_seen = [0]

        async def run(client: WorkspaceClient) -> int:
            done = 0
            for round_ in range(ROUNDS):
                calls = [0]

                async def change(
                    state: SubDocState, calls: list[int] = calls, first: bool = round_ == 0
                ) -> Any:
                    calls[0] += 1
                    if first and calls[0] == 1:
                        await first_reads.wait()  # the first round surely conflicts once
                    return plus_one(state)

                try:
                    await client.read_modify_write(WS, DOC, change)
                except VersionConflictError:
                    pass  # retries spent: not applied, not counted
                else:
                    done += 1
                conflicts_seen[0] += calls[0] - 1
            return done

        done = await asyncio.wait_for(asyncio.gather(run(a), run(b)), timeout=60)
        _, state = await a.get_state(WS, DOC)
        assert count_of(state) == sum(done)
        assert sum(done) > ROUNDS  # both clients made progress
        assert conflicts_seen[0] >= 1  # the race did happen, and was retried
    finally:
        await a.close()
        await b.close()


async def test_read_modify_write_gives_up_after_the_policys_retries_with_its_waits(
    server_url: str,
) -> None:
    sleep = RecordingSleep()
    config = fast_config(sleep=sleep)
    async with WorkspaceClient(server_url, token=token_for(WS), config=config) as client:
        await client.apply_op(WS, DOC, NodeInsert(node_id="c", parent_id="root"))
        runs = [0]

        async def change(state: SubDocState) -> list[NodeUpdate]:
            runs[0] += 1
            # Another writer commits between every read and its write.
            await client.apply_op(WS, DOC, NodeUpdate(node_id="c", set={"other": runs[0]}))
            return plus_one(state)

        with pytest.raises(VersionConflictError) as raised:
            await client.read_modify_write(WS, DOC, change, uniform=lambda low, high: 1.0)
        _, state = await client.get_state(WS, DOC)
    assert runs[0] == 4
    assert sleep.delays == pytest.approx([0.025, 0.05, 0.1])
    assert raised.value.clock == 5
    assert count_of(state) == 0
