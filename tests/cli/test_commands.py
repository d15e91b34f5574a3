"""`cv-workspace` (in a thread, against the in-process server) and `cv-worker` (a real process
against the same server): answers as JSON, exit codes, SIGTERM drain."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from cv_workspace_client import WorkspaceClient
from cv_workspace_client._queue import requester as api
from cv_workspace_client.cli.conventions import EXIT_TIMEOUT
from cv_workspace_client.cli.stages_module import load_stages
from cv_workspace_client.cli.workspace import workspace_main
from cv_workspace_client.stage import StageContext
from cv_workspace_client.worker import Worker, WorkerConfig
from tests.worker.conftest import WS, MakeServer, running, token_for, url_of

FAST = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05)


async def _cli(
    capsys: pytest.CaptureFixture[str], server: TestServer, *args: str
) -> tuple[int, Any]:
    argv = [*args, "--json", "--url", url_of(server), "--token", token_for(WS)]
    code = await asyncio.to_thread(workspace_main, argv)
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else json.loads(err)


async def _triple(ctx: StageContext) -> Any:
    return ctx.input * 3


async def test_enqueue_with_wait_prints_the_result(
    capsys: pytest.CaptureFixture[str], client: WorkspaceClient, server: TestServer
) -> None:
    async with running(Worker(client, {"triple": _triple}, config=FAST)):
        code, answer = await _cli(
            capsys, server, "enqueue", "--workspace", WS, "--stage", "triple", "--job-id", "J1",
            "--input", "14", "--wait", "--timeout", "30",
        )  # fmt: skip
    assert code == 0
    assert answer["status"] == "done"
    assert answer["result"] == 42
    assert answer["enqueued"]["coalesced"] is False


async def test_a_wait_that_times_out_exits_3_with_the_id_and_a_later_wait_gets_the_result(
    capsys: pytest.CaptureFixture[str], client: WorkspaceClient, server: TestServer
) -> None:
    code, answer = await _cli(
        capsys, server, "enqueue", "--workspace", WS, "--stage", "triple", "--job-id", "J1",
        "--input", "2", "--wait", "--timeout", "0.2",
    )  # fmt: skip
    assert code == EXIT_TIMEOUT
    assert answer["status"] == "timeout"
    assert answer["request_status"] == "pending"
    request_id = answer["request_id"]
    async with running(Worker(client, {"triple": _triple}, config=FAST)):
        code, later = await _cli(
            capsys, server, "requests", "wait", "--workspace", WS, request_id, "--timeout", "30"
        )
    assert code == 0
    assert later["result"] == 6
    code, shown = await _cli(capsys, server, "requests", "show", "--workspace", WS, request_id)
    assert code == 0
    assert shown["status"] == "done"
    assert "claim_token" not in shown


async def test_operators_list_replay_and_rerun_from_the_shell(
    capsys: pytest.CaptureFixture[str], make_server: MakeServer
) -> None:
    server = await make_server(failure_backoff_seconds=0.0)
    runs = 0

    async def flaky(ctx: StageContext) -> Any:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise RuntimeError("first run breaks")
        return runs

    async with WorkspaceClient(url_of(server), token=token_for(WS)) as client:
        code, answer = await _cli(
            capsys, server, "enqueue", "--workspace", WS, "--stage", "flaky", "--job-id", "J1",
            "--max-dequeues", "1",
        )  # fmt: skip
        assert code == 0
        request_id = answer["request_id"]
        async with running(Worker(client, {"flaky": flaky}, config=FAST)):
            outcome = await api.wait_request(client, WS, request_id, timeout=30)
            assert outcome.status == "poison"
            code, listed = await _cli(capsys, server, "requests", "list", "--status", "poison",
                                      "--workspace", WS)  # fmt: skip
            assert [row["request_id"] for row in listed["requests"]] == [request_id]
            code, replayed = await _cli(
                capsys, server, "requests", "replay", "--workspace", WS, request_id
            )
            assert code == 0
            assert replayed["status"] == "pending"
            assert (await api.wait_request(client, WS, request_id, timeout=30)).result == 2
            code, rerun = await _cli(
                capsys, server, "requests", "rerun", "--workspace", WS, "--stage", "flaky",
                "--job-id", "J1", "--wait", "--timeout", "30",
            )  # fmt: skip
    assert code == 0
    assert rerun["result"] == 3
    assert rerun["request"]["run"] == 2


async def test_an_operator_discards_a_poison_request_from_the_shell(
    capsys: pytest.CaptureFixture[str], make_server: MakeServer
) -> None:
    server = await make_server()

    async def broken(ctx: StageContext) -> Any:
        raise RuntimeError("always breaks")

    async with WorkspaceClient(url_of(server), token=token_for(WS)) as client:
        answer = await client.enqueue(WS, stage="broken", job_id="J1", max_dequeues=1)
        async with running(Worker(client, {"broken": broken}, config=FAST)):
            outcome = await api.wait_request(client, WS, answer.request_id, timeout=30)
        assert outcome.status == "poison"
        code, discarded = await _cli(
            capsys, server, "requests", "discard", "--workspace", WS, answer.request_id
        )
        assert code == 0
        assert (discarded["request_id"], discarded["status"]) == (answer.request_id, "poison")
        code, listed = await _cli(capsys, server, "requests", "list", "--workspace", WS)
        assert listed["requests"] == []
        code, error = await _cli(
            capsys, server, "requests", "discard", "--workspace", WS, answer.request_id
        )
        assert (code, error["error"]["code"]) == (1, "not_found")
        done = await client.enqueue(WS, stage="broken", job_id="J2")
        code, error = await _cli(
            capsys, server, "requests", "discard", "--workspace", WS, done.request_id
        )
        assert (code, error["error"]["code"]) == (1, "not_discardable")


async def test_bad_usage_and_refusals_exit_with_their_codes(
    capsys: pytest.CaptureFixture[str], server: TestServer
) -> None:
    code, error = await _cli(
        capsys, server, "enqueue", "--workspace", WS, "--stage", "s", "--input", "{nope"
    )
    assert code == 2
    assert error["error"]["code"] == "usage"
    code, error = await _cli(capsys, server, "requests", "show", "--workspace", "other-ws", "d_x")
    assert code == 1
    assert error["error"]["code"] == "forbidden_workspace"


def test_load_stages_accepts_a_dict_and_refuses_anything_else() -> None:
    from cv_workspace_client.cli.conventions import UsageError

    assert set(load_stages("tests.worker.cli_stages:STAGES")) == {"double"}
    for spec in (
        "tests.worker.cli_stages",
        "tests.worker.cli_stages:NOT_A_DICT",
        "tests.worker.cli_stages:MISSING",
        "no_such_module_here:STAGES",
    ):
        with pytest.raises(UsageError):
            load_stages(spec)


async def test_the_worker_command_runs_stages_and_drains_on_sigterm(server: TestServer) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cv_workspace_client.cli", "worker",
        "--url", url_of(server), "--token", token_for(WS),
        "--stages", "tests.worker.cli_stages:STAGES", "--worker-id", "cli-worker",
        "--log-level", "WARNING",
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        ready = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert ready.decode().startswith("cv-worker cli-worker ready")
        async with api.QueueClient(url_of(server), token_for(WS)) as qc:
            answer = await qc.enqueue(WS, stage="double", job_id="J1", input=21)
            done = await qc.wait_request(WS, answer.request_id, timeout=30)
            bad = await qc.enqueue(WS, stage="double", job_id="J2", input="x")
            refused = await qc.wait_request(WS, bad.request_id, timeout=30)
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code == 0
    assert done.result == 42
    assert done.request is not None
    assert done.request.claimed_by == "cli-worker"
    assert refused.error is not None
    assert refused.error["code"] == "bad_input"


async def test_url_and_token_come_from_the_environment(
    capsys: pytest.CaptureFixture[str], server: TestServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CV_URL", url_of(server))
    monkeypatch.setenv("CV_TOKEN", token_for(WS))
    argv = ["enqueue", "--workspace", WS, "--stage", "s", "--job-id", "J9"]
    code = await asyncio.to_thread(workspace_main, argv)
    answer = json.loads(capsys.readouterr().out)
    assert code == 0
    assert answer["status"] == "pending"
    assert answer["request_id"].startswith("d_")


async def test_requests_list_all_follows_every_page(
    capsys: pytest.CaptureFixture[str], server: TestServer
) -> None:
    ids = []
    for i in range(5):
        code, answer = await _cli(
            capsys, server, "enqueue", "--workspace", WS, "--stage", "s", "--job-id", f"J{i}"
        )
        assert code == 0
        ids.append(answer["request_id"])
    code, one_page = await _cli(
        capsys, server, "requests", "list", "--workspace", WS, "--limit", "2"
    )
    assert code == 0
    assert [row["request_id"] for row in one_page["requests"]] == ids[:2]
    code, every = await _cli(
        capsys, server, "requests", "list", "--workspace", WS, "--limit", "2", "--all"
    )
    assert code == 0
    assert [row["request_id"] for row in every["requests"]] == ids
