"""`WorkspaceClient.apply_ops_and_enqueue` through a real server on loopback, on SQLite and on
PostgreSQL (docs/queue.md#start-work-with-the-change-that-needs-it): the ops and their work
commit together; an answer lost after the commit is retried under the same op_ids, which
enqueues nothing twice and is answered with the same requests."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from cv_mutations import NodeIncrement, NodeInsert
from cv_server import ServerConfig, create_app
from cv_server.auth import mint_token
from cv_server.cli import _with_schema
from cv_workspace_client import (
    Commit,
    EnqueueItem,
    ForbiddenError,
    OpRejectedError,
    VersionConflictError,
    WorkspaceClient,
)
from tests.pg.helpers import fresh_schema

from .helpers import SECRET, WS, fast_config, token_for

ServerFactory = Callable[..., Awaitable[TestServer]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
DOC = "jobs"


class LoseFirstAnswer:
    """A middleware that lets the first apply commit, then answers it 503 as a proxy that lost
    the server's answer would: the client cannot tell whether it committed."""

    def __init__(self) -> None:
        self.lost = 0

    @web.middleware
    async def __call__(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        answer = await handler(request)
        if request.method == "POST" and request.path.endswith("/ops") and not self.lost:
            self.lost += 1
            raise web.HTTPServiceUnavailable()
        return answer


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def config(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Callable[[], ServerConfig]]:
    if request.param == "sqlite":
        yield lambda: ServerConfig(db_path=tmp_path / "server.db", token_secret=SECRET)
        return
    postgres_url: str = request.getfixturevalue("postgres_url")
    async with fresh_schema(postgres_url) as schema:
        database_url = _with_schema(postgres_url, schema)
        yield lambda: ServerConfig(database_url=database_url, token_secret=SECRET)


async def open_client(server: TestServer, token: str | None = None) -> WorkspaceClient:
    url = str(server.make_url("")).rstrip("/")
    client = WorkspaceClient(url, token=token or token_for(WS), config=fast_config())
    await client.start()
    return client


async def test_the_ops_and_the_requests_commit_together(
    aiohttp_server: ServerFactory, config: Callable[[], ServerConfig]
) -> None:
    server = await aiohttp_server(create_app(config()))
    client = await open_client(server)
    try:
        done = await client.apply_ops_and_enqueue(
            WS,
            DOC,
            [NodeInsert(node_id="j1", parent_id="root"), NodeIncrement(node_id="j1", field="v")],
            [EnqueueItem("evaluate", job_id="j1", input={"node": "j1"}), EnqueueItem("score")],
        )
        assert [type(r) for r in done.results] == [Commit, Commit]
        assert all(item is not None and not item.coalesced for item in done.enqueued)
        for item in done.enqueued:
            assert item is not None
            row = await client.get_request(WS, item.request_id)
            assert (row.status, row.caused_by_clock) == ("pending", 2)
    finally:
        await client.close()


async def test_a_lost_answer_is_retried_and_enqueues_nothing_twice(
    aiohttp_server: ServerFactory, config: Callable[[], ServerConfig]
) -> None:
    losing = LoseFirstAnswer()
    app = create_app(config())
    app.middlewares.append(losing.__call__)
    server = await aiohttp_server(app)
    client = await open_client(server)
    try:
        done = await client.apply_ops_and_enqueue(
            WS, DOC, [NodeInsert(node_id="j1", parent_id="root")], [EnqueueItem("evaluate")]
        )
        assert losing.lost == 1
        (result,) = done.results
        assert isinstance(result, Commit)
        assert result.duplicate  # the retry was answered from the first commit's record
        (item,) = done.enqueued
        assert item is not None
        assert item.coalesced  # the request the first attempt enqueued
        row = await client.get_request(WS, item.request_id)
        assert (row.run, row.caused_by_clock) == (1, 1)
    finally:
        await client.close()


async def test_a_batch_that_applies_nothing_enqueues_nothing(
    aiohttp_server: ServerFactory, config: Callable[[], ServerConfig]
) -> None:
    server = await aiohttp_server(create_app(config()))
    client = await open_client(server)
    try:
        done = await client.apply_ops_and_enqueue(
            WS,
            DOC,
            [NodeInsert(node_id="j1", parent_id="root"), NodeInsert(node_id="x", parent_id="no")],
            [EnqueueItem("evaluate", job_id="j1")],
            atomic=True,
        )
        assert all(isinstance(r, OpRejectedError) for r in done.results)
        assert done.enqueued == [None]
        with pytest.raises(VersionConflictError):
            await client.apply_ops_and_enqueue(
                WS,
                DOC,
                [NodeInsert(node_id="j1", parent_id="root")],
                [EnqueueItem("evaluate", job_id="j1")],
                if_clock=5,
            )
        clock, _ = await client.get_state(WS, DOC)
        assert clock == 0
    finally:
        await client.close()


async def test_a_token_without_the_enqueue_scope_is_refused_and_nothing_applied(
    aiohttp_server: ServerFactory, config: Callable[[], ServerConfig]
) -> None:
    server = await aiohttp_server(create_app(config()))
    writer = mint_token(SECRET, [WS], now=time.time(), ttl=600, scopes=["write", "read"])
    client = await open_client(server, writer)
    try:
        with pytest.raises(ForbiddenError) as refused:
            await client.apply_ops_and_enqueue(
                WS, DOC, [NodeInsert(node_id="j1", parent_id="root")], [EnqueueItem("evaluate")]
            )
        assert refused.value.required_scopes == ("enqueue",)
        clock, _ = await client.get_state(WS, DOC)
        assert clock == 0
    finally:
        await client.close()
