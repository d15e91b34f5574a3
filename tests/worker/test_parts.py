"""The worker's parts without a server: TTL cache, single-flight, keys, telemetry, op ids."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cv_workspace_client.stage import (
    ExpectedError,
    LeaseLostError,
    Stage,
    StageContext,
    StageRequest,
    op_id_for,
)
from cv_workspace_client.worker import WorkerConfig
from cv_workspace_client.worker.parts import RunMeter, SingleFlight, TtlCache, request_key

# Pure: no file, socket or database (the `unit` cost mark; see tests/conftest.py).
pytestmark = pytest.mark.unit


def _request(**overrides: Any) -> StageRequest:
    values: dict[str, Any] = {
        "request_id": "d_abc",
        "workspace_id": "ws1",
        "stage": "evaluate",
        "job_id": "J1",
        "branch_path": None,
        "input": {"b": 1, "a": [1, 2]},
        "run": 1,
        "dequeue_count": 1,
        "created_at": 100.0,
        "claimed_at": 101.5,
    }
    values.update(overrides)
    return StageRequest(**values)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_cached_value_is_fresh_until_its_ttl_passes() -> None:
    clock = Clock()
    cache: TtlCache[str] = TtlCache(10, clock)
    cache.put("k", {"v": 1}, ttl=5)
    clock.now = 4.9
    assert cache.get("k") == (True, {"v": 1})
    clock.now = 5.0
    assert cache.get("k") == (False, None)
    assert len(cache) == 0


def test_the_cache_evicts_its_oldest_entry_past_its_cap() -> None:
    cache: TtlCache[int] = TtlCache(500, Clock())
    for key in range(501):
        cache.put(key, key, ttl=60)
    assert len(cache) == 500
    assert cache.get(0) == (False, None)
    assert cache.get(1) == (True, 1)
    cache.put(1, "again", ttl=60)  # re-stored: now the newest
    cache.put(501, 501, ttl=60)
    assert cache.get(1) == (True, "again")
    assert cache.get(2) == (False, None)


def test_the_worker_defaults_are_the_design_constants() -> None:
    config = WorkerConfig()
    assert (config.idle_initial_seconds, config.idle_max_seconds) == (0.1, 2.0)
    assert config.heartbeat_seconds == 60.0
    assert config.drain_seconds == 25.0
    assert config.cache_entries == 500
    assert config.concurrency == 1


def test_the_request_key_ignores_key_order_but_not_scope() -> None:
    base = request_key(_request())
    assert base == request_key(_request(input={"a": [1, 2], "b": 1}, request_id="other"))
    assert base != request_key(_request(workspace_id="ws2"))
    assert base != request_key(_request(job_id="J2"))
    assert base != request_key(_request(input={"a": [2, 1], "b": 1}))
    assert request_key(_request(input=float("nan"))) is None
    assert request_key(_request(input={1, 2})) is None


async def test_single_flight_shares_the_leaders_value() -> None:
    flight: SingleFlight[str] = SingleFlight()
    gate = asyncio.Event()
    runs = 0

    async def work() -> int:
        nonlocal runs
        runs += 1
        await gate.wait()
        return 7

    tasks = [asyncio.create_task(flight.run("k", work)) for _ in range(3)]
    await asyncio.sleep(0)
    gate.set()
    results = await asyncio.gather(*tasks)
    assert runs == 1
    assert sorted(results) == [(7, False), (7, True), (7, True)]
    assert not flight.running("k")


async def test_single_flight_shares_an_expected_error_with_followers() -> None:
    flight: SingleFlight[str] = SingleFlight()
    gate = asyncio.Event()

    async def work() -> int:
        await gate.wait()
        raise ExpectedError("bad_input", "no")

    tasks = [asyncio.create_task(flight.run("k", work)) for _ in range(2)]
    await asyncio.sleep(0)
    gate.set()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert [type(o) for o in outcomes] == [ExpectedError, ExpectedError]


async def test_followers_run_on_their_own_when_the_leader_is_cancelled() -> None:
    flight: SingleFlight[str] = SingleFlight()
    leader_started = asyncio.Event()
    runs: list[str] = []

    async def stuck() -> int:
        runs.append("leader")
        leader_started.set()
        await asyncio.Event().wait()
        return 0

    async def quick() -> int:
        runs.append("follower")
        return 1

    leader = asyncio.create_task(flight.run("k", stuck))
    await leader_started.wait()
    follower = asyncio.create_task(flight.run("k", quick))
    await asyncio.sleep(0)
    leader.cancel()
    assert await follower == (1, False)
    assert runs == ["leader", "follower"]
    with pytest.raises(asyncio.CancelledError):
        await leader


async def test_followers_run_on_their_own_when_the_leader_lost_its_lease() -> None:
    flight: SingleFlight[str] = SingleFlight()
    gate = asyncio.Event()

    async def lost() -> int:
        await gate.wait()
        raise LeaseLostError()

    async def fine() -> int:
        return 2

    leader = asyncio.create_task(flight.run("k", lost))
    await asyncio.sleep(0)
    follower = asyncio.create_task(flight.run("k", fine))
    await asyncio.sleep(0)
    gate.set()
    assert await follower == (2, False)
    with pytest.raises(LeaseLostError):
        await leader


def test_telemetry_reports_wall_cpu_rss_and_queue_wait() -> None:
    ticks = iter([10.0, 12.5])
    cpu = iter([1.0, 1.25])
    meter = RunMeter(_request(), wall=lambda: next(ticks), cpu=lambda: next(cpu), rss=lambda: 4096)
    data = meter.start().finish(shared=True)
    assert data == {
        "wall_s": 2.5,
        "cpu_s": 0.25,
        "rss_bytes": 4096,
        "queue_wait_s": 1.5,
        "shared": True,
    }


def test_a_broken_telemetry_probe_drops_the_telemetry_and_nothing_else() -> None:
    def broken() -> int:
        raise OSError("no /proc here")

    assert RunMeter(_request(), rss=broken).start().finish() is None

    def broken_clock() -> float:
        raise RuntimeError("clock")

    assert RunMeter(_request(), wall=broken_clock).start().finish() is None
    assert RunMeter(_request()).start().finish(bad=float("nan")) is None


@given(st.text(min_size=1, max_size=80), st.integers(1, 10_000), st.text(max_size=80))
def test_derived_op_ids_are_valid_and_stable_per_run(request_id: str, run: int, key: str) -> None:
    op_id = op_id_for(request_id, run, key)
    assert re.fullmatch(r"[A-Za-z0-9_-]{8,64}", op_id)
    assert op_id == op_id_for(request_id, run, key)
    assert op_id != op_id_for(request_id, run + 1, key)
    assert op_id != op_id_for(request_id, run, key + "x")


def test_the_context_exposes_the_request_and_refuses_writes_once_the_lease_is_lost() -> None:
    from cv_workspace_client.stage import LeaseState

    lease = LeaseState()
    ctx = StageContext(_request(), client=None, worker_id="w", lease=lease)  # type: ignore[arg-type]
    assert (ctx.workspace_id, ctx.stage, ctx.job_id, ctx.input) == (
        "ws1",
        "evaluate",
        "J1",
        {"b": 1, "a": [1, 2]},
    )
    assert ctx.op_id_for("k") == op_id_for("d_abc", 1, "k")
    ctx.ensure_lease()
    lease.lost = True
    with pytest.raises(LeaseLostError) as caught:
        ctx.ensure_lease()
    assert caught.value.code == "lease_lost"


def test_a_stage_refuses_a_non_positive_ttl() -> None:
    async def handler(ctx: StageContext) -> None:
        return None

    with pytest.raises(ValueError, match="ttl"):
        Stage(handler, ttl=0)
    assert Stage(handler).worker_class is None


def test_a_request_is_built_from_a_row() -> None:
    row = {
        "request_id": "d_1",
        "workspace_id": "ws1",
        "stage": "s",
        "job_id": None,
        "branch_path": "a/b",
        "input": [1],
        "run": 2,
        "dequeue_count": 3,
        "created_at": 1.0,
        "claimed_at": None,
        "claim_token": "secret",
    }
    request = StageRequest.from_row(row)
    assert (request.run, request.dequeue_count, request.claimed_at) == (2, 3, None)
    assert request.branch_path == "a/b"
