"""The worker runner through a real server on loopback and a real `WorkspaceClient`."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from cv_mutations import NodeIncrement, NodeInsert
from cv_workspace_client import WorkspaceClient
from cv_workspace_client._queue import requester as api
from cv_workspace_client.stage import ExpectedError, LeaseLostError, Stage, StageContext
from cv_workspace_client.testing import FaultProxy
from cv_workspace_client.worker import Worker, WorkerConfig
from tests.server.helpers import lift_long_poll_ceiling
from tests.worker.conftest import (
    WS,
    MakeServer,
    fast_client_config,
    long_polls_registered,
    open_client,
    running,
    token_for,
    url_of,
)

FAST = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05)


async def test_a_stage_runs_once_and_completes_with_its_result(client: WorkspaceClient) -> None:
    calls: list[Any] = []

    async def echo(ctx: StageContext) -> Any:
        calls.append(ctx.input)
        return {"echo": ctx.input, "job": ctx.job_id}

    worker = Worker(client, {"echo": echo}, worker_id="w-echo", config=FAST)
    async with running(worker):
        answer = await api.enqueue(client, WS, {"stage": "echo", "job_id": "J1", "input": [1, 2]})
        outcome = await api.wait_request(client, WS, answer.request_id, timeout=30)
    assert outcome.status == "done"
    assert outcome.result == {"echo": [1, 2], "job": "J1"}
    assert calls == [[1, 2]]
    assert outcome.request is not None
    assert outcome.request.dequeue_count == 1
    assert outcome.request.claimed_by == "w-echo"
    telemetry = outcome.request.telemetry
    assert set(telemetry) >= {"wall_s", "cpu_s", "rss_bytes", "queue_wait_s"}
    assert telemetry["rss_bytes"] > 0
    assert telemetry["queue_wait_s"] >= 0


async def test_an_expected_error_completes_with_its_payload_after_one_attempt(
    client: WorkspaceClient,
) -> None:
    calls = 0

    async def picky(ctx: StageContext) -> Any:
        nonlocal calls
        calls += 1
        raise ExpectedError("bad_input", "cols is required", {"missing": ["cols"]})

    worker = Worker(client, {"picky": picky}, config=FAST)
    async with running(worker):
        answer = await api.enqueue(client, WS, {"stage": "picky", "job_id": "J1"})
        outcome = await api.wait_request(client, WS, answer.request_id, timeout=30)
    assert outcome.status == "done"
    assert outcome.error == {
        "code": "bad_input",
        "message": "cols is required",
        "details": {"missing": ["cols"]},
    }
    assert not outcome.ok
    assert outcome.request is not None
    assert outcome.request.dequeue_count == 1
    assert calls == 1
    assert worker.stats.expected_errors == 1


async def test_an_always_failing_stage_ends_in_poison_after_max_dequeues(
    make_server: MakeServer,
) -> None:
    server = await make_server(failure_backoff_seconds=0.0)
    calls = 0

    async def broken(ctx: StageContext) -> Any:
        nonlocal calls
        calls += 1
        raise RuntimeError(f"attempt {ctx.request.dequeue_count} broke")

    async with open_client(server) as client:
        worker = Worker(client, {"broken": broken}, config=FAST)
        async with running(worker):
            answer = await api.enqueue(
                client, WS, {"stage": "broken", "job_id": "J1", "max_dequeues": 3}
            )
            outcome = await api.wait_request(client, WS, answer.request_id, timeout=30)
    assert outcome.status == "poison"
    assert calls == 3
    assert outcome.error == {"code": "RuntimeError", "message": "attempt 3 broke"}
    assert worker.stats.failed == 3


async def test_a_lapsed_lease_is_redriven_and_the_old_holder_writes_and_completes_nothing(
    make_server: MakeServer,
) -> None:
    server = await make_server(lease_seconds=0.3)
    stalled = asyncio.Event()
    seen_by_old_holder: list[str] = []

    async def stage(ctx: StageContext) -> Any:
        if ctx.worker_id == "old":
            stalled.set()
            try:
                await asyncio.Event().wait()  # stalls past its lease; only cancellation ends it
            except asyncio.CancelledError:
                try:
                    ctx.ensure_lease()
                except LeaseLostError as exc:
                    seen_by_old_holder.append(exc.code)
                try:
                    await ctx.apply_op(
                        "tree", NodeInsert(node_id="late", parent_id="root"), key="x"
                    )
                except LeaseLostError as exc:
                    seen_by_old_holder.append(exc.code)
                raise
        return {"by": ctx.worker_id, "attempt": ctx.request.dequeue_count}

    async with (
        open_client(server) as client,
        FaultProxy(url_of(server)) as proxy,
        WorkspaceClient(proxy.url, token=token_for(WS), config=fast_client_config()) as cut_off,
    ):
        # The old holder reaches the server through a proxy: once its stage stalls, the link is
        # cut (a partition), so its heartbeats fail and the lease lapses while it is alive.
        old = Worker(
            cut_off,
            {"s": stage},
            worker_id="old",
            config=WorkerConfig(idle_initial_seconds=0.01, heartbeat_seconds=0.05),
        )
        new = Worker(client, {"s": stage}, worker_id="new", config=FAST)
        async with running(old):
            answer = await api.enqueue(client, WS, {"stage": "s", "job_id": "J1"})
            await asyncio.wait_for(stalled.wait(), 10)
            proxy.refuse = True
            proxy.drop_all()
            async with running(new):
                outcome = await api.wait_request(client, WS, answer.request_id, timeout=30)
                # Healed: the old holder's next heartbeat hears that the lease is gone.
                proxy.refuse = False
                async with asyncio.timeout(10):
                    while old.stats.leases_lost == 0:  # noqa: ASYNC110  (a state, not a duration)
                        await asyncio.sleep(0.01)
        _, state = await client.get_state(WS, "tree")
    assert outcome.status == "done"
    assert outcome.result == {"by": "new", "attempt": 2}
    assert seen_by_old_holder == ["lease_lost", "lease_lost"]
    assert old.stats.completed == 0
    assert old.stats.failed == 0
    assert "late" not in state.nodes


async def test_the_ttl_cache_answers_a_second_identical_request_with_a_hit(
    client: WorkspaceClient,
) -> None:
    calls = 0

    async def lookup(ctx: StageContext) -> Any:
        nonlocal calls
        calls += 1
        return {"value": ctx.input["q"].upper()}

    worker = Worker(client, {"lookup": Stage(lookup, ttl=60)}, config=FAST)
    body = {"stage": "lookup", "input": {"q": "abc"}, "deterministic": False}
    async with running(worker):
        first = await api.enqueue(client, WS, body, idempotency_key="k1")
        first_outcome = await api.wait_request(client, WS, first.request_id, timeout=30)
        second = await api.enqueue(client, WS, body, idempotency_key="k2")
        second_outcome = await api.wait_request(client, WS, second.request_id, timeout=30)
        other = await api.enqueue(client, WS, {**body, "input": {"q": "xyz"}}, idempotency_key="k3")
        other_outcome = await api.wait_request(client, WS, other.request_id, timeout=30)
    assert first.request_id != second.request_id
    assert first_outcome.result == second_outcome.result == {"value": "ABC"}
    assert first_outcome.request is not None
    assert first_outcome.request.cache == "miss"
    assert second_outcome.request is not None
    assert second_outcome.request.cache == "hit"
    assert other_outcome.request is not None
    assert other_outcome.request.cache == "miss"
    assert calls == 2  # abc once, xyz once


async def test_identical_concurrent_requests_share_one_run(client: WorkspaceClient) -> None:
    calls = 0
    release = asyncio.Event()

    async def slow(ctx: StageContext) -> Any:
        nonlocal calls
        calls += 1
        await release.wait()
        return {"n": ctx.input["n"] * 2}

    worker = Worker(client, {"slow": slow}, config=WorkerConfig(concurrency=4))
    body = {"stage": "slow", "input": {"n": 21}, "deterministic": False}
    answers = [await api.enqueue(client, WS, body, idempotency_key=f"k{i}") for i in range(3)]
    async with running(worker):
        async with asyncio.timeout(10):
            while worker.stats.claimed < 3:  # noqa: ASYNC110  (all three held at once)
                await asyncio.sleep(0.01)
        release.set()
        outcomes = [await api.wait_request(client, WS, a.request_id, timeout=30) for a in answers]
    assert [o.result for o in outcomes] == [{"n": 42}] * 3
    assert calls == 1
    assert worker.stats.shared_runs == 2
    shared = [o.request.telemetry.get("shared", False) for o in outcomes if o.request]
    assert sorted(shared) == [False, True, True]


async def test_stages_run_concurrently_up_to_the_configured_limit(
    client: WorkspaceClient,
) -> None:
    started: list[str] = []
    all_started = asyncio.Event()

    async def gather_up(ctx: StageContext) -> Any:
        started.append(ctx.request.request_id)
        if len(started) == 3:
            all_started.set()
        await asyncio.wait_for(all_started.wait(), 10)  # only returns if 3 run at once
        return len(started)

    worker = Worker(client, {"g": gather_up}, config=WorkerConfig(concurrency=3))
    async with running(worker):
        answers = [
            await api.enqueue(client, WS, {"stage": "g", "job_id": f"J{i}"}) for i in range(4)
        ]
        outcomes = [await api.wait_request(client, WS, a.request_id, timeout=30) for a in answers]
    assert all(o.status == "done" for o in outcomes)
    assert [o.result for o in outcomes[:3]] == [3, 3, 3]


async def test_stop_drains_an_in_flight_stage_before_run_returns(client: WorkspaceClient) -> None:
    started = asyncio.Event()
    release = asyncio.Event()

    async def slow(ctx: StageContext) -> Any:
        started.set()
        await release.wait()
        return "finished"

    worker = Worker(client, {"slow": slow}, config=FAST)
    run = asyncio.create_task(worker.run())
    first = await api.enqueue(client, WS, {"stage": "slow", "job_id": "J1"})
    await asyncio.wait_for(started.wait(), 10)
    worker.stop()
    later = await api.enqueue(client, WS, {"stage": "slow", "job_id": "J2"})
    done, _ = await asyncio.wait({run}, timeout=0.3)
    assert not done  # still draining: the stage has not finished
    release.set()
    stats = await asyncio.wait_for(run, 10)
    row = await api.get_request(client, WS, first.request_id)
    assert row.status == "done"
    assert row.result == "finished"
    assert stats.clean
    assert stats.completed == 1
    assert (await api.get_request(client, WS, later.request_id)).status == "pending"


async def test_the_drain_deadline_cancels_a_stage_and_reports_nothing(
    client: WorkspaceClient,
) -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def stuck(ctx: StageContext) -> Any:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    worker = Worker(
        client, {"stuck": stuck}, config=WorkerConfig(idle_initial_seconds=0.01, drain_seconds=0.2)
    )
    run = asyncio.create_task(worker.run())
    answer = await api.enqueue(client, WS, {"stage": "stuck", "job_id": "J1"})
    await asyncio.wait_for(started.wait(), 10)
    worker.stop()
    stats = await asyncio.wait_for(run, 10)
    assert cancelled.is_set()
    assert not stats.clean
    assert stats.cancelled_at_drain == 1
    row = await api.get_request(client, WS, answer.request_id)
    # Neither completed nor failed: the row re-drives when its lease lapses.
    assert row.status == "in_progress"
    assert row.dequeue_count == 1
    assert row.error is None


async def test_a_write_repeated_after_a_redrive_is_deduped_by_the_server(
    make_server: MakeServer,
) -> None:
    server = await make_server(failure_backoff_seconds=0.0)
    commits = []

    async def count_then_crash_once(ctx: StageContext) -> Any:
        commit = await ctx.apply_op(
            "tree", NodeIncrement(node_id="counter", field="n", by=1), key="inc"
        )
        commits.append(commit)
        if ctx.request.dequeue_count == 1:
            raise RuntimeError("crashed after the write")
        return {"clock": commit.clock}

    async with open_client(server) as client:
        await client.apply_op(WS, "tree", NodeInsert(node_id="counter", parent_id="root"))
        worker = Worker(client, {"count": count_then_crash_once}, config=FAST)
        async with running(worker):
            answer = await api.enqueue(client, WS, {"stage": "count", "job_id": "J1"})
            outcome = await api.wait_request(client, WS, answer.request_id, timeout=30)
        _, state = await client.get_state(WS, "tree")
    assert outcome.status == "done"
    assert len(commits) == 2
    assert commits[0].op_id == commits[1].op_id
    assert (commits[0].duplicate, commits[1].duplicate) == (False, True)
    assert state.nodes["counter"].fields["n"] == 1


async def test_a_rerun_on_purpose_writes_again(client: WorkspaceClient) -> None:
    async def count(ctx: StageContext) -> Any:
        commit = await ctx.apply_op("tree", NodeIncrement(node_id="c", field="n"), key="inc")
        return commit.op_id

    await client.apply_op(WS, "tree", NodeInsert(node_id="c", parent_id="root"))
    worker = Worker(client, {"count": count}, config=FAST)
    async with running(worker):
        first = await api.enqueue(client, WS, {"stage": "count", "job_id": "J1"})
        one = await api.wait_request(client, WS, first.request_id, timeout=30)
        plain = await api.enqueue(client, WS, {"stage": "count", "job_id": "J1"})
        rerun = await api.enqueue(client, WS, {"stage": "count", "job_id": "J1", "rerun": True})
        two = await api.wait_request(client, WS, rerun.request_id, timeout=30)
    _, state = await client.get_state(WS, "tree")
    assert plain.coalesced
    assert plain.status == "done"
    assert rerun.request_id == first.request_id
    assert one.result != two.result  # run 2 derives new op_ids
    assert state.nodes["c"].fields["n"] == 2


async def test_an_idle_worker_is_woken_by_the_push_well_before_its_poll_ceiling(
    server: TestServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    picked_up = asyncio.Event()
    ceiling = 2.0  # the server's long poll cap, and this worker's only idle wait
    assert server.app is not None
    # The server holds the poll an hour instead: only the push can wake the worker in time.
    lift_long_poll_ceiling(server.app, monkeypatch)

    async def note(ctx: StageContext) -> Any:
        picked_up.set()
        return None

    async with open_client(server) as client:
        worker = Worker(
            client,
            {"note": note},
            config=WorkerConfig(idle_initial_seconds=ceiling, idle_max_seconds=ceiling),
        )
        async with running(worker):
            await long_polls_registered(server, 1)
            await api.enqueue(client, WS, {"stage": "note", "job_id": "J1"})
            await asyncio.wait_for(picked_up.wait(), 10)


async def test_a_stage_this_worker_does_not_have_is_failed_for_another_worker(
    make_server: MakeServer,
) -> None:
    server = await make_server(failure_backoff_seconds=0.0)

    async def known(ctx: StageContext) -> Any:
        return "known"

    async with open_client(server) as client:
        worker = Worker(client, {"known": known}, worker_class="shared", config=FAST)
        async with running(worker):
            answer = await api.enqueue(
                client,
                WS,
                {"stage": "unknown", "job_id": "J1", "worker_class": "shared", "max_dequeues": 1},
            )
            outcome = await api.wait_request(client, WS, answer.request_id, timeout=30)
    assert outcome.status == "poison"
    assert outcome.error["code"] == "unknown_stage"


async def test_a_large_result_completes_through_the_blob_store(client: WorkspaceClient) -> None:
    big = "x" * (200 * 1024)

    async def large(ctx: StageContext) -> Any:
        return {"text": big}

    worker = Worker(client, {"large": large}, config=FAST)
    async with running(worker):
        answer = await api.enqueue(client, WS, {"stage": "large", "job_id": "J1"})
        outcome = await api.wait_request(client, WS, answer.request_id, timeout=30)
    assert outcome.request is not None
    assert outcome.request.blob_ref is not None
    assert outcome.request.result is None
    assert outcome.result == {"text": big}


async def test_a_batch_refused_as_a_whole_completes_one_by_one(make_server: MakeServer) -> None:
    # The server moves results over 100 bytes to blobs, which its batch route refuses to do.
    server = await make_server(blob_threshold_bytes=100)
    release = asyncio.Event()

    async def mixed(ctx: StageContext) -> Any:
        await release.wait()
        return "y" * ctx.input

    async with open_client(server) as client:
        worker = Worker(client, {"mixed": mixed}, config=WorkerConfig(concurrency=2))
        answers = [
            await api.enqueue(client, WS, {"stage": "mixed", "job_id": f"J{n}", "input": n})
            for n in (10, 500)
        ]
        async with running(worker):
            async with asyncio.timeout(10):
                while worker.stats.claimed < 2:  # noqa: ASYNC110  (both in one batch)
                    await asyncio.sleep(0.01)
            release.set()
            small, large = [await api.wait_request(client, WS, a.request_id, 30) for a in answers]
    assert small.result == "y" * 10
    assert large.result == "y" * 500
    assert large.request is not None
    assert large.request.blob_ref is not None
    assert worker.stats.completed == 2
