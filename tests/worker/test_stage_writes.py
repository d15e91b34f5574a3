"""Exactly-once stage writes across re-drives, and what the worker does with answers it cannot
send: through a real server on loopback and real `WorkspaceClient`s.

A stage is at-least-once; `StageContext.apply_op` derives each op_id from
`(request_id, run, key)` so a re-driven attempt of the same run re-sends the same op_ids and the
server dedupes them, while a deliberate `rerun` (run + 1) writes anew (stage.py's docstring).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from cv_mutations import NodeIncrement, NodeInsert
from cv_server import ServerConfig, create_app
from cv_workspace_client import WorkspaceClient
from cv_workspace_client._queue import holder as holder
from cv_workspace_client._queue import requester as api
from cv_workspace_client.errors import OpRejectedError
from cv_workspace_client.stage import (
    ExpectedError,
    LeaseLostError,
    Stage,
    StageContext,
    StageRequest,
)
from cv_workspace_client.worker import Worker, WorkerConfig
from tests.worker.conftest import (
    SECRET,
    WS,
    MakeServer,
    ServerFactory,
    fast_client_config,
    open_client,
    running,
    token_for,
    url_of,
)

FAST = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05)


async def increments(client: WorkspaceClient, workspace: str, sub_doc: str) -> list[str | None]:
    """op_ids of every committed `node.increment` of the sub-doc, duplicates (if any) included."""
    _, entries = await client.read_ops(workspace, sub_doc, since=0, limit=1000)
    return [e.op_id for e in entries if e.op.model_dump()["type"] == "node.increment"]


async def test_a_stage_that_crashes_midway_ends_with_each_of_its_writes_applied_once(
    make_server: MakeServer,
) -> None:
    server = await make_server(failure_backoff_seconds=0.0)
    attempts: list[int] = []

    async def three_writes(ctx: StageContext) -> Any:
        attempts.append(ctx.request.dequeue_count)
        for n, key in enumerate(("a", "b", "c")):
            await ctx.apply_op("tree", NodeIncrement(node_id="c", field=key), key=key)
            if n == ctx.request.dequeue_count - 1 < 2:  # attempt 1 dies after a, attempt 2 after b
                raise RuntimeError(f"crash after {key}")
        return "ok"

    async with open_client(server) as client:
        await client.apply_op(WS, "tree", NodeInsert(node_id="c", parent_id="root"))
        worker = Worker(client, {"w": three_writes}, config=FAST)
        async with running(worker):
            answer = await api.enqueue(client, WS, {"stage": "w", "job_id": "J1"})
            outcome = await api.wait_request(client, WS, answer.request_id, timeout=30)
        _, state = await client.get_state(WS, "tree")
        log = await increments(client, WS, "tree")
    assert outcome.status == "done"
    assert attempts == [1, 2, 3]
    assert state.nodes["c"].fields == {"a": 1, "b": 1, "c": 1}
    assert len(log) == len(set(log)) == 3


async def test_the_same_key_in_other_requests_sub_docs_and_workspaces_never_collides(
    make_server: MakeServer,
) -> None:
    server = await make_server()
    op_ids: list[tuple[str, str, str]] = []

    async def bump(ctx: StageContext) -> Any:
        for sub_doc in ("tree", "jobs"):
            commit = await ctx.apply_op(sub_doc, NodeIncrement(node_id="c", field="n"), key="k")
            assert not commit.duplicate
            op_ids.append((ctx.workspace_id, sub_doc, commit.op_id))
        return None

    async with WorkspaceClient(
        url_of(server), token=token_for(WS, "ws2"), config=fast_client_config()
    ) as client:
        for ws in (WS, "ws2"):
            for sub_doc in ("tree", "jobs"):
                await client.apply_op(ws, sub_doc, NodeInsert(node_id="c", parent_id="root"))
        worker = Worker(client, {"bump": bump}, config=FAST)
        async with running(worker):
            answers = [
                (ws, await api.enqueue(client, ws, {"stage": "bump", "job_id": job}))
                for ws in (WS, "ws2")
                for job in ("J1", "J2")
            ]
            for ws, answer in answers:
                outcome = await api.wait_request(client, ws, answer.request_id, timeout=30)
                assert outcome.status == "done", outcome
        counts = {
            (ws, sub_doc): (await client.get_state(ws, sub_doc))[1].nodes["c"].fields["n"]
            for ws in (WS, "ws2")
            for sub_doc in ("tree", "jobs")
        }
    assert counts == {key: 2 for key in counts}  # J1 and J2 each wrote once everywhere
    # Different requests (jobs, workspaces) derive different op_ids; one request uses one op_id
    # per key in each sub-doc, which the server scopes to (workspace, sub_doc).
    per_request = {op_id for _, _, op_id in op_ids}
    assert len(per_request) == 4
    assert len(op_ids) == 8


async def test_a_key_reused_for_a_different_op_is_refused_and_completes_with_the_refusal(
    make_server: MakeServer,
) -> None:
    server = await make_server(failure_backoff_seconds=0.0)
    seen: list[tuple[int, bool, str | None]] = []

    async def reuse(ctx: StageContext) -> Any:
        first = await ctx.apply_op("tree", NodeIncrement(node_id="c", field="n"), key="k")
        try:
            await ctx.apply_op("tree", NodeIncrement(node_id="c", field="m"), key="k")
        except OpRejectedError as exc:
            seen.append((ctx.request.dequeue_count, first.duplicate, exc.code))
            raise
        return None

    async with open_client(server) as client:
        await client.apply_op(WS, "tree", NodeInsert(node_id="c", parent_id="root"))
        worker = Worker(client, {"reuse": reuse}, config=FAST)
        async with running(worker):
            answer = await api.enqueue(
                client, WS, {"stage": "reuse", "job_id": "J1", "max_dequeues": 2}
            )
            outcome = await api.wait_request(client, WS, answer.request_id, timeout=30)
        _, state = await client.get_state(WS, "tree")
    # A refusal for good is the request's answer (docs/queue.md): one attempt, no retry.
    assert seen == [(1, False, "op_id_reuse")]
    assert outcome.status == "done"
    assert outcome.error["code"] == "op_id_reuse"
    assert outcome.error["details"]["op"]["key"] == "k"
    assert state.nodes["c"].fields == {"n": 1}  # the first write once; the second never


async def test_the_same_op_under_the_same_key_twice_in_one_run_applies_once(
    client: WorkspaceClient,
) -> None:
    # Documented: one distinct key per write. Two intents under one key collapse into one.
    async def twice(ctx: StageContext) -> Any:
        op = NodeIncrement(node_id="c", field="n")
        one = await ctx.apply_op("tree", op, key="k")
        two = await ctx.apply_op("tree", op, key="k")
        return [one.op_id == two.op_id, one.duplicate, two.duplicate]

    await client.apply_op(WS, "tree", NodeInsert(node_id="c", parent_id="root"))
    worker = Worker(client, {"twice": twice}, config=FAST)
    async with running(worker):
        answer = await api.enqueue(client, WS, {"stage": "twice", "job_id": "J1"})
        outcome = await api.wait_request(client, WS, answer.request_id, timeout=30)
    _, state = await client.get_state(WS, "tree")
    assert outcome.result == [True, False, True]
    assert state.nodes["c"].fields["n"] == 1


async def test_empty_long_unicode_and_surrogate_keys_derive_op_ids_the_server_accepts(
    client: WorkspaceClient,
) -> None:
    keys = ["", "x" * 20_000, "é🙂\u202e", "\ud800", "a\x00b", "k", "K"]

    async def weird(ctx: StageContext) -> Any:
        commits = [
            await ctx.apply_op("tree", NodeIncrement(node_id="c", field=f"f{i}"), key=key)
            for i, key in enumerate(keys)
        ]
        return [c.duplicate for c in commits]

    await client.apply_op(WS, "tree", NodeInsert(node_id="c", parent_id="root"))
    worker = Worker(client, {"weird": weird}, config=FAST)
    async with running(worker):
        answer = await api.enqueue(client, WS, {"stage": "weird", "job_id": "J1"})
        outcome = await api.wait_request(client, WS, answer.request_id, timeout=30)
    _, state = await client.get_state(WS, "tree")
    log = await increments(client, WS, "tree")
    assert outcome.status == "done", outcome.error
    assert outcome.result == [False] * len(keys)
    assert state.nodes["c"].fields == {f"f{i}": 1 for i in range(len(keys))}
    assert len(set(log)) == len(keys)


async def test_a_write_after_an_unnoticed_lease_loss_dedupes_with_the_new_holders_write(
    make_server: MakeServer,
) -> None:
    # The lease lapsed and another worker re-drove the request, but the old holder's heartbeat has
    # not run yet: `ensure_lease` cannot know, so its write reaches the server. The derived op_id
    # is what keeps the write once: the new holder's attempt of the same run re-sends it.
    server = await make_server(lease_seconds=0.05)
    async with open_client(server) as client:
        await client.apply_op(WS, "tree", NodeInsert(node_id="c", parent_id="root"))
        answer = await api.enqueue(client, WS, {"stage": "s", "job_id": "J1"})
        (old,) = await holder.claim(client, ["s"], "old")
        async with asyncio.timeout(10):
            # A state, not a duration: until the server hands the lapsed row out again.
            while not (claims := await holder.claim(client, ["s"], "new")):  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        (new,) = claims
        contexts = [
            StageContext(StageRequest.from_row(c.request.raw), client, worker_id=name)
            for c, name in ((old, "old"), (new, "new"))
        ]
        assert [c.request.dequeue_count for c in contexts] == [1, 2]
        commits = []
        for ctx in contexts:
            ctx.ensure_lease()  # the old one does not know yet
            commits.append(
                await ctx.apply_op("tree", NodeIncrement(node_id="c", field="n"), key="inc")
            )
        with pytest.raises(LeaseLostError):
            await holder.complete(client, WS, answer.request_id, old.claim_token, result="old")
        assert await holder.complete(client, WS, answer.request_id, new.claim_token) == "done"
        _, state = await client.get_state(WS, "tree")
    assert commits[0].op_id == commits[1].op_id
    assert [c.duplicate for c in commits] == [False, True]
    assert state.nodes["c"].fields["n"] == 1


@pytest.mark.parametrize(
    "bad", [{1, 2}, {"x": float("nan")}, float("inf"), b"bytes"], ids=["set", "nan", "inf", "bytes"]
)
async def test_a_non_json_result_fails_as_invalid_result_and_counts_as_no_completion(
    make_server: MakeServer, bad: Any
) -> None:
    server = await make_server(failure_backoff_seconds=0.0)
    calls = 0

    async def wrong(ctx: StageContext) -> Any:
        nonlocal calls
        calls += 1
        return bad

    async def fine(ctx: StageContext) -> Any:
        return "fine"

    async with open_client(server) as client:
        worker = Worker(client, {"wrong": wrong, "fine": fine}, config=FAST)
        async with running(worker):
            answer = await api.enqueue(
                client, WS, {"stage": "wrong", "job_id": "J1", "max_dequeues": 2}
            )
            outcome = await api.wait_request(client, WS, answer.request_id, timeout=30)
            after = await api.enqueue(client, WS, {"stage": "fine", "job_id": "J1"})
            alive = await api.wait_request(client, WS, after.request_id, timeout=30)
    assert outcome.status == "poison"
    assert outcome.error["code"] == "invalid_result"
    assert calls == 2
    assert alive.result == "fine"  # the worker lives on
    assert (worker.stats.failed, worker.stats.completed) == (2, 1)


async def test_a_non_json_result_of_a_cached_stage_is_not_cached_and_its_retry_runs_again(
    make_server: MakeServer,
) -> None:
    # An answer that could not be sent is not an answer: caching it would replay the same
    # invalid_result on every retry without running the handler, all the way to poison.
    server = await make_server(failure_backoff_seconds=0.0)
    calls = 0

    async def flaky(ctx: StageContext) -> Any:
        nonlocal calls
        calls += 1
        return {"set": {1}} if calls == 1 else {"ok": calls}

    async with open_client(server) as client:
        worker = Worker(client, {"flaky": Stage(flaky, ttl=60)}, config=FAST)
        async with running(worker):
            answer = await api.enqueue(
                client, WS, {"stage": "flaky", "job_id": "J1", "max_dequeues": 3}
            )
            outcome = await api.wait_request(client, WS, answer.request_id, timeout=30)
    assert outcome.status == "done", outcome.error
    assert outcome.result == {"ok": 2}
    assert calls == 2
    assert outcome.request is not None
    assert outcome.request.cache == "miss"


async def test_an_expected_error_with_non_json_details_is_still_an_answer_never_retried(
    make_server: MakeServer,
) -> None:
    # An expected error completes the request; it is never retried. Details
    # that have no JSON form must not turn the answer into a retry loop that ends in poison.
    server = await make_server(failure_backoff_seconds=0.0)
    calls = 0

    async def picky(ctx: StageContext) -> Any:
        nonlocal calls
        calls += 1
        raise ExpectedError("bad_input", "cols is required", {"missing": {"cols"}})

    async with open_client(server) as client:
        worker = Worker(client, {"picky": picky}, config=FAST)
        async with running(worker):
            answer = await api.enqueue(
                client, WS, {"stage": "picky", "job_id": "J1", "max_dequeues": 3}
            )
            outcome = await api.wait_request(client, WS, answer.request_id, timeout=30)
    assert outcome.status == "done"
    assert calls == 1
    assert outcome.error["code"] == "bad_input"
    assert outcome.error["message"] == "cols is required"
    assert "cols" in str(outcome.error["details"])  # kept, in a form JSON can carry
    assert (worker.stats.expected_errors, worker.stats.failed) == (1, 0)


async def test_a_completion_refused_for_good_completes_with_the_refusal_instead_of_a_lease_wait(
    make_server: MakeServer,
) -> None:
    # The completion is refused for good (413: an error payload past the body limit; results
    # go through the upload): the request must complete with a clear code now, once, not sit
    # unacknowledged in progress until its 120 s lease lapses nor be re-run toward poison.
    server = await make_server(max_body_bytes=128 * 1024, failure_backoff_seconds=0.0)
    calls = 0

    async def huge(ctx: StageContext) -> Any:
        nonlocal calls
        calls += 1
        raise ExpectedError("bad_input", "too much to say", details="x" * (256 * 1024))

    async with open_client(server) as client:
        worker = Worker(client, {"huge": huge}, config=FAST)
        async with running(worker):
            answer = await api.enqueue(
                client, WS, {"stage": "huge", "job_id": "J1", "max_dequeues": 2}
            )
            outcome = await api.wait_request(client, WS, answer.request_id, timeout=10)
    assert outcome.status == "done"
    assert outcome.error["code"] == "result_refused"
    assert "body_too_large" in outcome.error["message"]
    assert calls == 1
    assert worker.stats.completed == 0


async def test_a_spawned_write_still_pending_fails_the_run_instead_of_completing_it(
    aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    # The handler spawns a write and returns without awaiting it; the write's retries run out
    # (StillPendingError: it waits in the outbox, not committed). Completing the request then
    # would acknowledge work whose write never landed (docs/stages.md: never ack before the work's
    # writes committed). The run must fail instead; its re-drive writes under the same op_id.
    refused: list[str] = []

    @web.middleware
    async def flaky_ops(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if (
            request.method == "POST"
            and request.path.endswith("/docs/flaky/ops")
            and len(refused) < 2
        ):
            refused.append(request.path)
            return web.json_response({"code": "unavailable", "detail": "injected"}, status=503)
        return await handler(request)

    app = create_app(
        ServerConfig(db_path=tmp_path / "s.db", token_secret=SECRET, failure_backoff_seconds=0.0)
    )
    app.middlewares.append(flaky_ops)
    server = await aiohttp_server(app)
    runs: list[int] = []

    async def spawns_a_write(ctx: StageContext) -> Any:
        runs.append(ctx.request.dequeue_count)
        op_ids.append(ctx.op_id_for("k"))
        spawned.append(
            asyncio.create_task(
                ctx.apply_op("flaky", NodeInsert(node_id="n", parent_id="root"), key="k")
            )
        )
        return "ok"

    spawned: list[asyncio.Task[Any]] = []
    op_ids: list[str] = []
    config = dataclasses.replace(fast_client_config(), retry_attempts=2, ops_over_websocket=False)
    async with WorkspaceClient(url_of(server), token=token_for(WS), config=config) as client:
        worker = Worker(client, {"w": spawns_a_write}, config=FAST)
        async with running(worker):
            answer = await api.enqueue(client, WS, {"stage": "w", "job_id": "J1"})
            outcome = await api.wait_request(client, WS, answer.request_id, timeout=30)
            # Done only once the write is in the log.
            _, entries = await client.read_ops(WS, "flaky", since=0, limit=100)
        await asyncio.gather(*spawned, return_exceptions=True)
    assert outcome.status == "done"
    assert len(refused) == 2
    assert runs == [1, 2]
    assert op_ids[0] == op_ids[1]  # the re-drive wrote under the same op_id
    assert [e.op_id for e in entries] == [op_ids[0]]  # committed once
