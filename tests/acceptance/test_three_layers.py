"""Acceptance: the three layers end to end with real processes (docs/concepts.md).

20 jobs x 5 columns, 8 `cv-worker` processes running the shipped `evaluate`, the counting fake
provider endpoint (one process, so the count spans every worker), and 4 SDK clients (1 + 3 extra)
enqueueing the same requests at once: every cell is paid for once, committed once, and seen once
by each of 2 subscribers — also with workers SIGKILLed mid-run (then calls <= 100 + kills).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.acceptance.procs import free_port, mint_cli_token
from tests.acceptance.three_layers_procs import Proc, server_cmd, worker_cmd
from tests.acceptance.three_layers_run import WS, RunReport, job_ids, run_evaluate

pytestmark = pytest.mark.acceptance

JOBS = 20
COLUMNS = 5
WORKERS = 8
CELLS = JOBS * COLUMNS


@dataclass
class Fleet:
    url: str
    token: str
    provider_url: str
    workers: list[Proc]


@contextmanager
def fleet(
    tmp_path: Path, *, provider_delay: float, heartbeat: float = 60.0, **shrunk: float
) -> Iterator[Fleet]:
    """The server (real `cv-server`, or the same app with `shrunk` durations), the fake
    provider and `WORKERS` workers, all stopped on exit."""
    db = tmp_path / "cv.db"
    token = mint_cli_token(db, WS)
    server = Proc(server_cmd(db, free_port(), **shrunk), tmp_path / "server.log", "listening on")
    provider = Proc(
        ["-m", "cv_workspace_client.stages.fake_provider", "--delay", str(provider_delay)],
        tmp_path / "provider.log",
        "listening on",
    )
    workers: list[Proc] = []
    try:
        server.start()
        provider.start()
        for i in range(WORKERS):
            args = worker_cmd(server.url, token, provider.url, f"w{i}", heartbeat)
            workers.append(Proc(args, tmp_path / f"worker{i}.log", "ready").spawn())
        for worker in workers:
            worker.wait_ready()
        yield Fleet(server.url, token, provider.url, workers)
    finally:
        for proc in [*workers, provider, server]:
            proc.stop()


def expected_cells() -> list[tuple[str, str]]:
    return sorted((job, f"eval:col{c}") for job in job_ids(JOBS) for c in range(COLUMNS))


def assert_each_cell_committed_and_seen_once(report: RunReport) -> None:
    assert [o.status for o in report.outcomes] == ["done"] * len(report.outcomes)
    assert all(o.error is None for o in report.outcomes), [o.error for o in report.outcomes]
    assert sorted(report.log_cells) == expected_cells()  # 100 writes, none twice
    assert len(report.seen) == 2
    for seen in report.seen:
        assert sorted(seen) == expected_cells()  # each subscriber: each cell exactly once


def test_same_requests_from_four_clients_pay_each_cell_once(tmp_path: Path) -> None:
    with fleet(tmp_path, provider_delay=0.05) as f:
        report = asyncio.run(run_evaluate(f.url, f.token, f.provider_url, jobs=JOBS))

    assert all(len(ids) == 1 for ids in report.request_ids.values())  # layer 1 coalesced them
    assert report.provider_calls == CELLS
    assert sorted(report.calls_by_prompt.values()) == [1] * CELLS
    assert_each_cell_committed_and_seen_once(report)


def test_requests_the_queue_does_not_merge_still_pay_each_cell_once(tmp_path: Path) -> None:
    # 4 clients x 20 non-deterministic requests: 80 stage runs race for 100 cells across 8
    # processes; only the compute lock (and its pre-flight) stands between them and 4x the bill.
    with fleet(tmp_path, provider_delay=0.05) as f:
        report = asyncio.run(
            run_evaluate(f.url, f.token, f.provider_url, jobs=JOBS, deterministic=False)
        )

    assert all(len(ids) == 4 for ids in report.request_ids.values())
    assert len(report.outcomes) == 4 * JOBS
    assert report.provider_calls == CELLS
    assert sorted(report.calls_by_prompt.values()) == [1] * CELLS
    assert_each_cell_committed_and_seen_once(report)


KILLS = 3


def test_workers_sigkilled_mid_run_leave_every_cell_committed_once(tmp_path: Path) -> None:
    # Shrunk so the dead workers' leases (4 s) and locks (5 s) lapse within the test's bound.
    with fleet(
        tmp_path, provider_delay=0.3, heartbeat=1.0, lease=4.0, lock_ttl=5.0, backoff=0.5
    ) as f:

        async def kill_mid_run(calls: Callable[[], Awaitable[int]]) -> None:
            async with asyncio.timeout(60):
                # Polling another process's counter: there is no event to wait on across processes.
                while await calls() < CELLS // 4:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            for worker in f.workers[:KILLS]:
                worker.kill()

        report = asyncio.run(
            run_evaluate(f.url, f.token, f.provider_url, jobs=JOBS, during=kill_mid_run)
        )

    assert_each_cell_committed_and_seen_once(report)
    # A killed worker had at most one paid call in flight (a stage runs its columns in order).
    assert CELLS <= report.provider_calls <= CELLS + KILLS
    redriven = [o for o in report.outcomes if o.request and o.request.dequeue_count > 1]
    assert redriven, "no kill landed mid-stage: the test did not test anything"
    print(f"kills={KILLS} provider_calls={report.provider_calls} redriven={len(redriven)}")
