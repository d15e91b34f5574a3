"""Acceptance (issue 5): the real server process with a shortened lease, 200 requests, four real
`cv-worker` processes — one SIGKILLed mid-stage, one sent SIGTERM mid-stage; and the server itself
SIGKILLed while workers hold requests and restarted. Each runs with the workers on their worker
channel and on the HTTP verbs (`cv-worker --transport`).

Every request ends `done` exactly once and the stage's increments total exactly 200 (nothing
written twice); the killed worker's request is re-driven after its lease; the drained worker
finishes its in-flight stage and exits 0. Alongside: an always-failing stage ends in poison, an
expected error completes with its payload after one attempt, and a waiter past its deadline gets
TIMEOUT and later fetches the result (through the `cv-workspace` command).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from cv_mutations import NodeInsert
from cv_workspace_client import WorkspaceClient
from cv_workspace_client._queue.requester import QueueClient
from tests.acceptance.procs import free_port, mint_cli_token
from tests.acceptance.queue_stages import COUNTER_DOC, COUNTER_NODE
from tests.acceptance.short_server import ShortServer

pytestmark = pytest.mark.acceptance

WS = "acc"
REQUESTS = 200
LEASE_S = 3.0
BACKOFF_S = 0.2
REPO = Path(__file__).resolve().parents[2]
#: Bound on the whole scenario once the workers are up.
SCENARIO_S = 120.0


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **extra}


class WorkerProcess:
    """One `cv-worker` process and the trail its stages leave (see `queue_stages`)."""

    def __init__(
        self,
        name: str,
        url: str,
        token: str,
        tmp: Path,
        stage_sleep: float,
        transport: str = "channel",
        concurrency: int = 1,
    ) -> None:
        self.transport = transport
        self.concurrency = concurrency
        self.name = name
        self.url = url
        self.token = token
        self.trail = tmp / f"{name}.trail"
        self.log = tmp / f"{name}.log"
        self.stage_sleep = stage_sleep
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        with self.log.open("w") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "cv_workspace_client.cli", "worker",
                "--url", self.url, "--token", self.token,
                "--stages", "tests.acceptance.queue_stages:STAGES",
                "--worker-id", self.name,
                "--heartbeat-seconds", str(LEASE_S / 4),
                "--drain-seconds", "20",
                "--transport", self.transport,
                "--concurrency", str(self.concurrency),
                "--log-level", "WARNING",
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                cwd=REPO,
                env=_env(CV_ACC_TRAIL=str(self.trail), CV_ACC_SLEEP=str(self.stage_sleep)),
            )  # fmt: skip
        assert self.proc.stdout is not None
        ready = await asyncio.wait_for(self.proc.stdout.readline(), 60)
        assert ready.decode().startswith(f"cv-worker {self.name} ready"), ready

    def events(self) -> list[list[str]]:
        if not self.trail.exists():
            return []
        return [line.split() for line in self.trail.read_text().splitlines() if line]

    async def holding(self) -> tuple[str, float]:
        """Wait until a stage is mid-way (started, write not committed); its request and claim
        time."""
        async with asyncio.timeout(60):
            while True:
                events = self.events()
                ended = {e[1] for e in events if e[0] == "end"}
                started = [e for e in events if e[0] == "start" and e[1] not in ended]
                if started:
                    return started[-1][1], float(started[-1][2])
                await asyncio.sleep(0.005)

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def wait(self) -> int:
        assert self.proc is not None
        return await asyncio.wait_for(self.proc.wait(), 60)

    async def ensure_stopped(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


async def _cli(url: str, token: str, *args: str) -> tuple[int, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cv_workspace_client.cli", "workspace", *args,
        "--url", url, "--token", token,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO, env=_env(),
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, json.loads(out or err)


@pytest.mark.parametrize("transport", ["channel", "http"])
async def test_four_workers_one_killed_one_drained_finish_every_request_exactly_once(
    tmp_path: Path, transport: str
) -> None:
    db = tmp_path / "cv.db"
    token = await asyncio.to_thread(mint_cli_token, db, WS)
    server = ShortServer(
        db,
        free_port(),
        tmp_path / "server.log",
        lease_seconds=LEASE_S,
        failure_backoff_seconds=BACKOFF_S,
    )
    await asyncio.to_thread(server.start)
    workers = [
        WorkerProcess("victim", server.url, token, tmp_path, 0.5, transport),
        WorkerProcess("drained", server.url, token, tmp_path, 1.0, transport),
        WorkerProcess("steady-1", server.url, token, tmp_path, 0.01, transport),
        WorkerProcess("steady-2", server.url, token, tmp_path, 0.01, transport),
    ]
    victim, drained, *steady = workers
    try:
        async with (
            WorkspaceClient(server.url, token=token) as client,
            QueueClient(server.url, token) as qc,
        ):
            await client.apply_op(
                WS, COUNTER_DOC, NodeInsert(node_id=COUNTER_NODE, parent_id="root")
            )
            poisoned = await qc.enqueue(WS, stage="acc_fail", job_id="f", max_dequeues=3)
            expected = await qc.enqueue(WS, stage="acc_expected", job_id="e")
            work = await asyncio.gather(
                *(
                    qc.enqueue(WS, stage="acc_work", job_id=f"job-{i}", input=i)
                    for i in range(REQUESTS)
                )
            )
            assert len({w.request_id for w in work}) == REQUESTS

            async with asyncio.timeout(SCENARIO_S):
                await asyncio.gather(*(w.start() for w in workers))

                killed_id, killed_claimed_at = await victim.holding()
                victim.signal(signal.SIGKILL)
                drained_id, _ = await drained.holding()
                drained.signal(signal.SIGTERM)

                # A waiter with a deadline shorter than the work: TIMEOUT, and the id to come back.
                code, timed_out = await _cli(
                    server.url, token, "enqueue", "--workspace", WS, "--stage", "acc_slow",
                    "--job-id", "slow", "--input", "1.0", "--wait", "--timeout", "0.3",
                )  # fmt: skip
                assert code == 3, timed_out
                assert timed_out["status"] == "timeout"

                assert await victim.wait() == -signal.SIGKILL
                assert await drained.wait() == 0  # drained cleanly

                outcomes = await asyncio.gather(
                    *(qc.wait_request(WS, w.request_id, timeout=SCENARIO_S) for w in work)
                )
                fail_outcome = await qc.wait_request(WS, poisoned.request_id, timeout=60)
                expected_outcome = await qc.wait_request(WS, expected.request_id, timeout=60)
                code, later = await _cli(
                    server.url, token, "requests", "wait", "--workspace", WS,
                    timed_out["request_id"], "--timeout", "60",
                )  # fmt: skip
                _, state = await client.get_state(WS, COUNTER_DOC)
                for worker in steady:
                    worker.signal(signal.SIGTERM)
                assert [await w.wait() for w in steady] == [0, 0]
    finally:
        for worker in workers:
            await worker.ensure_stopped()
        await asyncio.to_thread(server.stop)

    # Every request done, once, with its own result; the counter proves each write landed once.
    assert [o.status for o in outcomes] == ["done"] * REQUESTS
    assert [o.result["n"] for o in outcomes] == list(range(REQUESTS))
    assert all(o.request is not None and o.request.run == 1 for o in outcomes)
    assert state.nodes[COUNTER_NODE].fields["n"] == REQUESTS
    ends: dict[str, list[str]] = {}
    for worker in workers:
        for event in worker.events():
            if event[0] == "end":
                ends.setdefault(event[1], []).append(worker.name)
    by_id = {o.request_id: o for o in outcomes}
    for request_id, outcome in by_id.items():
        # Each request's stage ran to its end once — or once more per lease re-drive (a stage
        # slower than its lease under load is re-driven; its write dedupes all the same).
        # The victim's runs count too: it may finish a request or two before it is caught
        # holding one (the others start later), and the one it was killed holding never ended.
        runs = ends.get(request_id, [])
        assert outcome.request is not None
        assert 1 <= len(runs) <= outcome.request.dequeue_count, (request_id, runs, outcome)

    # The killed worker's request was re-driven by another worker, after its lease.
    redriven = by_id[killed_id].request
    assert redriven is not None
    assert redriven.claimed_by != "victim"
    assert redriven.dequeue_count == 2
    assert redriven.claimed_at is not None
    assert redriven.claimed_at >= killed_claimed_at + LEASE_S

    # The drained worker finished what it held, and claimed nothing after the signal.
    finished = by_id[drained_id].request
    assert finished is not None
    assert finished.claimed_by == "drained"
    assert finished.dequeue_count == 1
    assert drained.events()[-1] == ["end", drained_id]

    assert fail_outcome.status == "poison"
    assert fail_outcome.request is not None
    assert fail_outcome.request.dequeue_count == 3
    assert fail_outcome.error == {"code": "RuntimeError", "message": "broken on dequeue 3"}

    assert expected_outcome.status == "done"
    assert expected_outcome.error == {
        "code": "not_found",
        "message": "no job e",
        "details": {"job_id": "e"},
    }
    assert expected_outcome.request is not None
    assert expected_outcome.request.dequeue_count == 1

    assert code == 0
    assert later["status"] == "done"
    assert later["result"] == {"slept": 1.0}


@pytest.mark.parametrize("transport", ["channel", "http"])
async def test_workers_ride_out_a_server_sigkilled_mid_channel_and_run_every_request_once(
    tmp_path: Path, transport: str
) -> None:
    """The server is SIGKILLed while two workers (4 slots each) hold requests and reports are on
    their way, then restarted on the same file and port: the workers reconnect (or claim over
    HTTP), every request ends done with its own result, and the counter shows each stage's
    write landed once (a request re-driven after its lease writes under the same op_id)."""
    db = tmp_path / "cv.db"
    token = await asyncio.to_thread(mint_cli_token, db, WS)
    port = free_port()
    durations = {"lease_seconds": LEASE_S, "failure_backoff_seconds": BACKOFF_S}
    server = ShortServer(db, port, tmp_path / "server.log", **durations)
    await asyncio.to_thread(server.start)
    requests = 120
    workers = [
        WorkerProcess(f"w{k}", server.url, token, tmp_path, 0.05, transport, concurrency=4)
        for k in range(2)
    ]
    try:
        async with QueueClient(server.url, token) as qc:
            async with WorkspaceClient(server.url, token=token) as client:
                await client.apply_op(
                    WS, COUNTER_DOC, NodeInsert(node_id=COUNTER_NODE, parent_id="root")
                )
            work = await asyncio.gather(
                *(
                    qc.enqueue(WS, stage="acc_work", job_id=f"job-{i}", input=i)
                    for i in range(requests)
                )
            )
            async with asyncio.timeout(SCENARIO_S):
                await asyncio.gather(*(w.start() for w in workers))
                while sum(e[0] == "end" for w in workers for e in w.events()) < requests // 4:  # noqa: ASYNC110  (a file)
                    await asyncio.sleep(0.01)
                assert server.proc is not None
                server.proc.kill()  # mid-channel: rows held, reports and claims on their way
                await asyncio.to_thread(server.proc.wait)
                await asyncio.to_thread(server.stop)
                server = ShortServer(db, port, tmp_path / "server.log", **durations)
                await asyncio.to_thread(server.start)
                outcomes = await asyncio.gather(
                    *(qc.wait_request(WS, w.request_id, timeout=SCENARIO_S) for w in work)
                )
        async with WorkspaceClient(server.url, token=token) as client:
            _, state = await client.get_state(WS, COUNTER_DOC)
        for worker in workers:
            worker.signal(signal.SIGTERM)
        assert [await w.wait() for w in workers] == [0, 0]
    finally:
        for worker in workers:
            await worker.ensure_stopped()
        await asyncio.to_thread(server.stop)
    assert [o.status for o in outcomes] == ["done"] * requests
    assert [o.result["n"] for o in outcomes] == list(range(requests))
    assert state.nodes[COUNTER_NODE].fields["n"] == requests  # each write landed once
    ends: dict[str, int] = {}
    for worker in workers:
        for event in worker.events():
            if event[0] == "end":
                ends[event[1]] = ends.get(event[1], 0) + 1
    for outcome in outcomes:
        assert outcome.request is not None
        # Once, or once more per lease re-drive (the server's death lapsed the leases it held).
        assert 1 <= ends.get(outcome.request_id, 0) <= outcome.request.dequeue_count
