"""Acceptance (issue 36): four real `cv-worker` processes and 200 requests over 10 concurrency
keys, `max_running_per_key = 2`, against the real server process, with the workers on the
worker channel and on the HTTP verbs (`cv-worker --transport`).

Sampled from the stages themselves (each logs its start and end, `keyed_stages`): no key ever
runs more than 2 at once; every request runs and completes exactly once; and a key whose stage
is slow (enqueued first, so oldest first alone would hand it every slot) takes only its 2 slots,
so the other keys' work is all done while the slow key is not yet half-way.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from pathlib import Path

import pytest

from cv_workspace_client._queue.requester import EnqueueItem, QueueClient
from tests.acceptance.procs import free_port, mint_cli_token
from tests.acceptance.short_server import ShortServer
from tests.acceptance.test_queue_workers import REPO, _env

pytestmark = pytest.mark.acceptance

WS = "acc"
KEYS = 10
PER_KEY = 20
LIMIT = 2
WORKERS = 4
#: Stages each worker runs at once: 16 slots in all, far more than the slow key's 2.
CONCURRENCY = 4
SLOW_KEY = "key-0"
SLOW_S = 1.0
FAST_S = 0.02
#: Bound on the whole scenario once the workers are up (the slow key alone needs 10 s).
SCENARIO_S = 90.0


async def _start_worker(
    name: str, url: str, token: str, tmp: Path, transport: str
) -> asyncio.subprocess.Process:
    log = (tmp / f"{name}.log").open("w")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cv_workspace_client.cli", "worker",
        "--url", url, "--token", token,
        "--stages", "tests.acceptance.keyed_stages:STAGES",
        "--worker-id", name, "--concurrency", str(CONCURRENCY), "--transport", transport,
        "--log-level", "WARNING",
        stdout=asyncio.subprocess.PIPE, stderr=log, cwd=REPO,
        env=_env(CV_ACC_TRAIL=str(tmp / f"{name}.trail")),
    )  # fmt: skip
    log.close()
    assert proc.stdout is not None
    ready = await asyncio.wait_for(proc.stdout.readline(), 60)
    assert ready.decode().startswith(f"cv-worker {name} ready"), ready
    return proc


def _most_at_once(events: list[tuple[float, int]]) -> int:
    """The most intervals open at once; at a tie an end comes first (-1 sorts before +1)."""
    running = most = 0
    for _, step in sorted(events):
        running += step
        most = max(most, running)
    return most


@pytest.mark.parametrize("transport", ["channel", "http"])
async def test_no_key_runs_more_than_its_limit_and_a_slow_key_delays_no_other(
    tmp_path: Path, transport: str
) -> None:
    db = tmp_path / "cv.db"
    token = await asyncio.to_thread(mint_cli_token, db, WS)
    server = ShortServer(db, free_port(), tmp_path / "server.log")
    await asyncio.to_thread(server.start)
    workers: list[asyncio.subprocess.Process] = []
    try:
        async with QueueClient(server.url, token) as qc:
            # The slow key's requests first: oldest first alone would give it every slot.
            items = [
                EnqueueItem(
                    stage="acc_keyed",
                    job_id=f"k{k}-{i}",
                    input={"key": f"key-{k}", "sleep": SLOW_S if k == 0 else FAST_S},
                    concurrency_key=f"key-{k}",
                    max_running_per_key=LIMIT,
                )
                for k in range(KEYS)
                for i in range(PER_KEY)
            ]
            enqueued = await qc.enqueue_many(WS, items)
            assert len({e.request_id for e in enqueued}) == KEYS * PER_KEY
            async with asyncio.timeout(SCENARIO_S):
                workers = list(
                    await asyncio.gather(
                        *(
                            _start_worker(f"w{n}", server.url, token, tmp_path, transport)
                            for n in range(WORKERS)
                        )
                    )
                )
                outcomes = await asyncio.gather(
                    *(qc.wait_request(WS, e.request_id, timeout=SCENARIO_S) for e in enqueued)
                )
    finally:
        for proc in workers:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        await asyncio.to_thread(server.stop)

    assert [o.status for o in outcomes] == ["done"] * (KEYS * PER_KEY)
    assert all(o.request is not None and o.request.run == 1 for o in outcomes)
    trail = [
        line.split()
        for n in range(WORKERS)
        if (tmp_path / f"w{n}.trail").exists()
        for line in (tmp_path / f"w{n}.trail").read_text().splitlines()
    ]
    # Every request ran exactly once: one start and one end each, none re-driven.
    starts = Counter(rid for kind, _, rid, _ in trail if kind == "start")
    ends = Counter(rid for kind, _, rid, _ in trail if kind == "end")
    assert set(starts.values()) == set(ends.values()) == {1}
    assert set(starts) == {e.request_id for e in enqueued}

    by_key: dict[str, list[tuple[float, int]]] = {}
    for kind, key, _, at in trail:
        by_key.setdefault(key, []).append((float(at), 1 if kind == "start" else -1))
    most = {key: _most_at_once(events) for key, events in by_key.items()}
    assert max(most.values()) <= LIMIT, most
    assert most[SLOW_KEY] == LIMIT  # the limit was reached, not merely never tried

    # The slow key used its 2 slots and no more: every other key was done before it had run
    # half its requests.
    slow_ends = sorted(float(at) for kind, key, _, at in trail if kind == "end" and key == SLOW_KEY)
    fast_last = max(float(at) for kind, key, _, at in trail if kind == "end" and key != SLOW_KEY)
    assert fast_last < slow_ends[PER_KEY // 2 - 1], (fast_last - slow_ends[0], slow_ends)
