"""The three-layer anti-patterns, one test each, through real workers and the real server:
remove (or misuse) a layer and its category of bug comes back; keep it and the layer does its job.

1. No compute lock: racing stage runs pay for the same cell more than once (layer 2).
2. The lock is workspace-internal: it does not, and must not, coordinate across workspaces — the
   queue does (layer 1).
3. Dedupe by the server's op_id, not a request hash on the client (layer 3).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from cv_mutations import NodeIncrement, NodeInsert
from cv_workspace_client import Commit, WorkspaceClient
from cv_workspace_client._queue import requester as api
from cv_workspace_client.stage import Handler, StageContext
from cv_workspace_client.stages import JOBS, make_evaluate
from cv_workspace_client.stages.evaluate import column_prompt, parse_columns
from cv_workspace_client.worker import Worker, WorkerConfig

from .conftest import OpenClient, StartServer
from .helpers import WS, GatedProvider, RequestLog, Watched, eval_writes

FAST = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05)
COLUMNS = ["fit", "seniority", "remote", "salary"]
JOB = "J1"


@asynccontextmanager
async def workers(
    clients: list[WorkspaceClient], stages: dict[str, Handler], provider: Any = None
) -> AsyncIterator[list[Worker]]:
    """One `Worker` per client, running in the background; stopped and drained on exit."""
    running = [
        Worker(c, stages, worker_id=f"w{i}", provider=provider, config=FAST)
        for i, c in enumerate(clients)
    ]
    tasks = [asyncio.create_task(w.run()) for w in running]
    try:
        yield running
    finally:
        for worker in running:
            worker.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)


async def race_two_runs(
    server_url: str, open_client: OpenClient, request_log: RequestLog, *, use_lock: bool
) -> tuple[GatedProvider, list[Any], list[tuple[str, str]]]:
    """Two evaluate requests for the same job that layer 1 does not merge (non-deterministic
    ids: two tabs, two agents), run by two workers at once while the provider is held shut."""
    clients = [await open_client(server_url) for _ in range(3)]
    await clients[0].apply_op(WS, JOBS, NodeInsert(node_id=JOB, parent_id="root"))
    provider = GatedProvider()
    stages = {"evaluate": make_evaluate(use_lock=use_lock)}
    async with workers(clients[1:], stages, provider):
        ids = [
            (
                await api.enqueue(
                    clients[0],
                    WS,
                    {
                        "stage": "evaluate",
                        "job_id": JOB,
                        "input": {"columns": COLUMNS},
                        "deterministic": False,
                    },
                    idempotency_key=f"tab-{i}",
                )
            ).request_id
            for i in range(2)
        ]
        # Column by column (the stage runs them in order): both runs reach the cell while the
        # provider is held shut, so both pre-flights find it empty. Without the lock both pay;
        # with it, one pays and the other has been told `locked` before the answer is let out.
        for column in COLUMNS:
            prompt = prompt_of(column)
            if use_lock:
                await provider.arrived_for(prompt).reach(1)
                await request_log.wait_locked(JOB, f"eval:{column}")
            else:
                await provider.arrived_for(prompt).reach(2)
            provider.open(prompt)
        outcomes = [await api.wait_request(clients[0], WS, i, timeout=30) for i in ids]
    return provider, [o.result for o in outcomes], await eval_writes(clients[0])


def prompt_of(column: str) -> str:
    return column_prompt(parse_columns({"columns": [column]})[0], JOB, {})


def eval_tasks() -> set[str]:
    return {f"eval:{c}" for c in COLUMNS}


async def test_without_the_compute_lock_racing_workers_pay_for_each_cell_twice(
    server_url: str, open_client: OpenClient, request_log: RequestLog
) -> None:
    provider, results, writes = await race_two_runs(
        server_url, open_client, request_log, use_lock=False
    )

    assert provider.calls == 2 * len(COLUMNS) > len(COLUMNS)
    assert all(count == 2 for count in provider.by_prompt.values())
    assert len(writes) == 2 * len(COLUMNS)  # and every cell was written twice
    assert sorted(len(r["computed"]) for r in results) == [len(COLUMNS), len(COLUMNS)]


async def test_with_the_compute_lock_racing_workers_pay_once_per_cell(
    server_url: str, open_client: OpenClient, request_log: RequestLog
) -> None:
    provider, results, writes = await race_two_runs(
        server_url, open_client, request_log, use_lock=True
    )

    assert provider.calls == len(COLUMNS)
    assert sorted(writes) == sorted((JOB, task) for task in eval_tasks())
    # Each cell computed by exactly one of the runs (which one may differ per cell).
    assert sorted(c for r in results for c in r["computed"]) == sorted(COLUMNS)
    assert results[0]["values"] == results[1]["values"]  # the waiter read the holder's writes


async def test_the_compute_lock_does_not_coordinate_across_workspaces_the_queue_does(
    server_url: str, open_client: OpenClient, request_log: RequestLog
) -> None:
    spaces = ["ws1", "ws2"]
    admin = [await open_client(server_url, ws) for ws in spaces]
    for ws, client in zip(spaces, admin, strict=True):
        await client.apply_op(ws, JOBS, NodeInsert(node_id=JOB, parent_id="root"))
    # One worker pool serves both tenants: the queue hands each row to exactly one of them.
    pool = [await open_client(server_url, *spaces) for _ in range(2)]
    provider = GatedProvider()
    async with workers(pool, {"evaluate": make_evaluate(use_lock=True)}, provider) as running:
        enqueued = []
        for ws, client in zip(spaces, admin, strict=True):
            body = {"stage": "evaluate", "job_id": JOB, "input": {"columns": COLUMNS}}
            first = await api.enqueue(client, ws, body)
            again = await api.enqueue(client, ws, body)  # a second tab: coalesced by layer 1
            assert again.request_id == first.request_id
            assert again.coalesced
            enqueued.append((ws, client, first.request_id))
        # Same job id, same tasks, two workspaces: for every cell both runs hold "the same" lock
        # and are in the provider at once. A lock shared across workspaces would have made one
        # tenant wait for — and read — the other's answer: a leak, not a saving.
        for column in COLUMNS:
            await provider.arrived_for(prompt_of(column)).reach(2)
            provider.open(prompt_of(column))
        assert request_log.locked == []
        outcomes = [await api.wait_request(c, ws, rid, timeout=30) for ws, c, rid in enqueued]

    assert [o.status for o in outcomes] == ["done", "done"]
    assert provider.calls == 2 * len(COLUMNS)
    for ws, client, _ in enqueued:
        assert sorted(await eval_writes(client, ws)) == sorted((JOB, t) for t in eval_tasks())
    assert sum(w.stats.completed for w in running) == 2
    assert {o.request.claimed_by for o in outcomes if o.request} <= {"w0", "w1"}


def counter_stage(
    write: Callable[[StageContext], Any], attempts: list[Commit | None], attempted: Watched
) -> Handler:
    """A stage that adds 1 to a counter, then crashes on its first attempt (after the write
    committed, before the completion): the queue re-drives it."""

    async def tally(ctx: StageContext) -> Any:
        attempts.append(await write(ctx))
        await attempted.add()
        if ctx.request.dequeue_count == 1:
            raise RuntimeError("crashed after the write, before the completion")
        return {"attempts": ctx.request.dequeue_count}

    return tally


async def run_redriven(
    start_server: StartServer,
    open_client: OpenClient,
    make_stage: Callable[[Watched], Handler],
) -> tuple[int, int]:
    """Enqueue one tally; attempt 1 runs on worker A (which then drains and goes away), the
    re-drive on worker B. Returns (the counter, the request's dequeue count)."""
    url = await start_server(failure_backoff_seconds=0.2)
    admin = await open_client(url)
    await admin.apply_op(WS, "counters", NodeInsert(node_id="c", parent_id="root"))
    answer = await api.enqueue(admin, WS, {"stage": "tally", "job_id": JOB})
    attempted = Watched()
    for n, name in enumerate(("A", "B"), start=1):
        client = await open_client(url)
        worker = Worker(client, {"tally": make_stage(attempted)}, worker_id=name, config=FAST)
        task = asyncio.create_task(worker.run())
        try:
            await attempted.reach(n, timeout=30)
        finally:
            worker.stop()  # drains: attempt 1's failure is reported before A is gone
            await asyncio.wait_for(task, 30)
    outcome = await api.wait_request(admin, WS, answer.request_id, timeout=30)
    assert outcome.status == "done"
    assert outcome.request is not None
    assert outcome.request.claimed_by == "B"
    _, state = await admin.get_state(WS, "counters")
    value = state.nodes["c"].fields["n"]
    assert isinstance(value, int)
    return value, outcome.request.dequeue_count


async def test_a_redriven_stage_writes_once_because_the_server_dedupes_its_derived_op_ids(
    start_server: StartServer, open_client: OpenClient
) -> None:
    attempts: list[Commit | None] = []

    async def write(ctx: StageContext) -> Commit:
        return await ctx.apply_op("counters", NodeIncrement(node_id="c", field="n"), key="tally")

    counter, dequeues = await run_redriven(
        start_server, open_client, lambda attempted: counter_stage(write, attempts, attempted)
    )

    assert dequeues == 2
    assert counter == 1  # an increment applied twice would show 2
    first, second = attempts
    assert first is not None
    assert second is not None
    assert not first.duplicate
    assert second.duplicate
    assert second.op_id == first.op_id
    assert second.clock == first.clock


async def test_a_redriven_stage_without_op_ids_applies_its_write_twice(
    start_server: StartServer, open_client: OpenClient
) -> None:
    attempts: list[Commit | None] = []

    async def write(ctx: StageContext) -> Commit:
        op = NodeIncrement(node_id="c", field="n")  # no op_id: the client mints a fresh one
        return await ctx.client.apply_op(ctx.workspace_id, "counters", op)

    counter, dequeues = await run_redriven(
        start_server, open_client, lambda attempted: counter_stage(write, attempts, attempted)
    )

    assert dequeues == 2
    assert counter == 2


async def test_a_client_side_request_hash_does_not_survive_the_redrive_on_another_worker(
    start_server: StartServer, open_client: OpenClient
) -> None:
    attempts: list[Commit | None] = []

    def make(attempted: Watched) -> Handler:
        sent: set[str] = set()  # the worker process's memory of what it already sent

        async def write(ctx: StageContext) -> Commit | None:
            op = NodeIncrement(node_id="c", field="n")
            digest = hashlib.sha256(
                json.dumps([ctx.request.request_id, op.model_dump()], sort_keys=True).encode()
            ).hexdigest()
            if digest in sent:
                return None
            sent.add(digest)
            return await ctx.client.apply_op(ctx.workspace_id, "counters", op)

        return counter_stage(write, attempts, attempted)

    counter, dequeues = await run_redriven(start_server, open_client, make)

    assert dequeues == 2
    assert counter == 2  # worker B never saw worker A's hashes; only the server's log did


async def test_a_content_hash_op_id_swallows_a_second_intent_that_looks_the_same(
    server_url: str, open_client: OpenClient
) -> None:
    client = await open_client(server_url)
    await client.apply_op(WS, "counters", NodeInsert(node_id="c", parent_id="root"))

    def content_id(op: NodeIncrement) -> str:
        return hashlib.sha256(op.model_dump_json().encode()).hexdigest()[:32]

    like = NodeIncrement(node_id="c", field="hashed")
    for _ in range(2):  # the user meant +1 twice
        await client.apply_op(WS, "counters", like.model_copy(update={"op_id": content_id(like)}))
    for _ in range(2):  # minted once per intent: both apply
        await client.apply_op(WS, "counters", NodeIncrement(node_id="c", field="minted"))

    _, state = await client.get_state(WS, "counters")
    assert state.nodes["c"].fields == {"hashed": 1, "minted": 2}
