"""The commands at their edges: bad durations are usage errors (exit 2, JSON on stderr, nothing
sent), `enqueue --wait` on a failed request exits 1 with the error, and a real `cv-worker`
process running the shipped `evaluate` stage over an OpenAI-compatible endpoint on 127.0.0.1
drains on SIGTERM/SIGINT: the stage in flight completes once, or (past the drain deadline) is
cancelled unacknowledged and re-driven after its lease — never lost, never completed twice."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from pytest_aiohttp import AiohttpServer

from cv_workspace_client import WorkspaceClient
from cv_workspace_client._queue import requester as api
from cv_workspace_client.cli.conventions import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from cv_workspace_client.cli.workspace import workspace_main
from cv_workspace_client.providers import OpenAICompatibleProvider
from cv_workspace_client.stage import ExpectedError, StageContext
from cv_workspace_client.stages import STAGES
from cv_workspace_client.stages.jobs import JOBS
from cv_workspace_client.worker import Worker, WorkerConfig
from tests.worker.conftest import WS, MakeServer, running, token_for, url_of

FAST = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05)
KEY = "sk-cli-SECRET-abcdef"


async def _cli(
    capsys: pytest.CaptureFixture[str], server: TestServer, *args: str
) -> tuple[int, Any, str]:
    argv = [*args, "--json", "--url", url_of(server), "--token", token_for(WS)]
    code = await asyncio.to_thread(workspace_main, argv)
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else json.loads(err), err


async def _worker_process(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cv_workspace_client.cli", "worker", *args, "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, err.decode()


# -- usage errors ---------------------------------------------------------------------------------


async def test_bad_worker_durations_and_log_levels_are_usage_errors_not_tracebacks() -> None:
    base = (
        "--url",
        "http://127.0.0.1:1",
        "--token",
        "t",
        "--stages",
        "tests.worker.cli_stages:STAGES",
    )
    bad = [
        ("--drain-seconds", "-1"),
        ("--drain-seconds", "nan"),
        ("--heartbeat-seconds", "0"),
        ("--heartbeat-seconds", "inf"),
        ("--log-level", "bogus"),
    ]
    results = await asyncio.gather(*(_worker_process(*base, *extra) for extra in bad))
    for extra, (code, err) in zip(bad, results, strict=True):
        assert "Traceback" not in err, (extra, err)
        assert code == EXIT_USAGE, (extra, err)
        error = json.loads(err.strip().splitlines()[-1])["error"]
        assert error["code"] == "usage"
        assert extra[0] in error["message"]


@pytest.mark.parametrize("seconds", ["inf", "nan", "-1"])
async def test_a_wait_timeout_that_is_not_a_duration_is_a_usage_error_and_enqueues_nothing(
    capsys: pytest.CaptureFixture[str], server: TestServer, seconds: str
) -> None:
    code, answer, err = await _cli(
        capsys, server, "enqueue", "--workspace", WS, "--stage", "s", "--job-id", "J1",
        "--wait", "--timeout", seconds,
    )  # fmt: skip
    assert code == EXIT_USAGE
    assert answer["error"]["code"] == "usage"
    assert "--timeout" in answer["error"]["message"]
    assert "Traceback" not in err
    code, listed, _ = await _cli(capsys, server, "requests", "list", "--workspace", WS)
    assert code == EXIT_OK
    assert listed["requests"] == []
    code, answer, _ = await _cli(
        capsys, server, "requests", "wait", "--workspace", WS, "d_x", "--timeout", seconds
    )
    assert code == EXIT_USAGE


# -- --wait on a failure --------------------------------------------------------------------------


async def _boom(ctx: StageContext) -> Any:
    raise RuntimeError("boom: the stage broke")


async def _refuse(ctx: StageContext) -> Any:
    raise ExpectedError("bad_input", "input must be an integer")


async def test_enqueue_wait_exits_1_with_the_error_when_the_request_ends_in_poison_or_an_error(
    capsys: pytest.CaptureFixture[str], make_server: MakeServer
) -> None:
    server = await make_server(failure_backoff_seconds=0.0)
    async with (
        WorkspaceClient(url_of(server), token=token_for(WS)) as client,
        running(Worker(client, {"boom": _boom, "refuse": _refuse}, config=FAST)),
    ):
        code, poisoned, _ = await _cli(
            capsys, server, "enqueue", "--workspace", WS, "--stage", "boom", "--job-id", "J1",
            "--max-dequeues", "1", "--wait", "--timeout", "30",
        )  # fmt: skip
        assert code == EXIT_FAILED
        assert poisoned["status"] == "poison"
        assert poisoned["error"]["code"] == "RuntimeError"
        assert "the stage broke" in poisoned["error"]["message"]
        code, refused, _ = await _cli(
            capsys, server, "enqueue", "--workspace", WS, "--stage", "refuse", "--job-id", "J2",
            "--wait", "--timeout", "30",
        )  # fmt: skip
    assert code == EXIT_FAILED
    assert refused["status"] == "done"
    assert refused["error"]["code"] == "bad_input"
    assert refused["error"]["message"] == "input must be an integer"


# -- a real cv-worker, SIGTERM while a provider call is in flight ---------------------------------


class Endpoint:
    """An OpenAI-compatible endpoint that holds each call until `release` is set."""

    def __init__(self) -> None:
        self.calls = 0
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()
        self.base_url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.calls += 1
        self.arrived.set()
        await self.release.wait()
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": "7"}}]})


@pytest.fixture
async def endpoint(aiohttp_server: AiohttpServer) -> AsyncIterator[Endpoint]:
    fake = Endpoint()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.handle)
    test_server = await aiohttp_server(app, host="127.0.0.1")
    fake.base_url = str(test_server.make_url("/v1"))
    yield fake
    fake.release.set()


async def _start_worker(
    server: TestServer, endpoint: Endpoint, *extra: str
) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cv_workspace_client.cli", "worker",
        "--url", url_of(server), "--token", token_for(WS),
        "--stages", "cv_workspace_client.stages:STAGES", "--worker-id", "cli-worker",
        "--provider", "openai", "--provider-url", endpoint.base_url, "--model", "m",
        "--log-level", "INFO", *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "CV_PROVIDER_API_KEY": KEY},
    )  # fmt: skip
    assert proc.stdout is not None
    ready = await asyncio.wait_for(proc.stdout.readline(), 60)
    assert ready.decode().startswith("cv-worker cli-worker ready"), ready
    return proc


async def _stop(proc: asyncio.subprocess.Process, sig: int) -> tuple[int, str]:
    try:
        proc.send_signal(sig)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, err.decode()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_signal_mid_provider_call_lets_the_stage_complete_once_and_claims_nothing_more(
    make_server: MakeServer, endpoint: Endpoint, sig: int
) -> None:
    server = await make_server()
    proc = await _start_worker(server, endpoint)
    async with api.QueueClient(url_of(server), token_for(WS)) as qc:
        first = await qc.enqueue(WS, stage="evaluate", job_id="J1", input={"columns": ["fit"]})
        await asyncio.wait_for(endpoint.arrived.wait(), 30)  # the paid call is in flight
        # Queued behind the running stage (concurrency 1): a draining worker must not take it.
        second = await qc.enqueue(WS, stage="evaluate", job_id="J2", input={"columns": ["fit"]})
        proc.send_signal(sig)
        endpoint.release.set()
        code, err = await _stop(proc, sig)
        done = await qc.wait_request(WS, first.request_id, timeout=30)
        left = await qc.get_request(WS, second.request_id)
    assert code == EXIT_OK, err
    assert "Traceback" not in err
    assert KEY not in err
    assert done.ok
    assert done.result == {"job_id": "J1", "values": {"fit": "7"}, "computed": ["fit"]}
    assert done.request is not None
    assert done.request.raw["dequeue_count"] == 1
    assert left.status == "pending"
    assert endpoint.calls == 1


async def test_past_the_drain_deadline_the_stage_is_cancelled_unacknowledged_and_redriven(
    make_server: MakeServer, endpoint: Endpoint
) -> None:
    # A short lease, for the re-drive to come soon; the compute lock keeps its 60 s (a stage
    # cancelled mid-call hands its key back at once, so the re-drive's budget is the whole TTL).
    server = await make_server(lease_seconds=1.0, failure_backoff_seconds=0.0)
    proc = await _start_worker(server, endpoint, "--drain-seconds", "0.3")
    async with WorkspaceClient(url_of(server), token=token_for(WS)) as client:
        answer = await client.enqueue(WS, stage="evaluate", job_id="J1", input={"columns": ["fit"]})
        await asyncio.wait_for(endpoint.arrived.wait(), 30)
        code, err = await _stop(proc, signal.SIGTERM)  # the provider never answered it
        assert code == EXIT_FAILED, err  # documented: 1 when the drain deadline cancelled work
        assert "Traceback" not in err
        row = await client.get_request(WS, answer.request_id)
        assert row.status == "in_progress"  # neither completed nor failed by the dead worker
        _, state = await client.get_state(WS, JOBS)
        assert "eval:fit" not in state.nodes["J1"].fields

        endpoint.release.set()  # from now on the provider answers at once
        async with (
            OpenAICompatibleProvider(endpoint.base_url, KEY, model="m") as provider,
            running(Worker(client, STAGES, provider=provider, config=FAST)),
        ):
            outcome = await client.wait_request(WS, answer.request_id, timeout=30)
        _, state = await client.get_state(WS, JOBS)
    assert outcome.ok
    assert outcome.result["values"] == {"fit": "7"}
    assert outcome.request is not None
    assert outcome.request.raw["dequeue_count"] == 2
    assert state.nodes["J1"].fields["eval:fit"] == "7"
    assert endpoint.calls == 2  # the cancelled call, then the re-drive's
