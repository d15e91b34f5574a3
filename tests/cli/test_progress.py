"""`cv-workspace` progress on stderr: `enqueue --wait` shows each status change of its request as
it happens (queued, claimed, done), `requests list --all` a count; stdout keeps the answer
alone, and nothing is shown unless asked for or stderr is a terminal."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from cv_workspace_client import WorkspaceClient
from cv_workspace_client.cli.progress import Progress
from cv_workspace_client.cli.workspace import workspace_main
from cv_workspace_client.stage import StageContext
from cv_workspace_client.worker import Worker, WorkerConfig
from tests.worker.conftest import WS, running, token_for, url_of

FAST = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05)


async def test_enqueue_wait_shows_queued_claimed_done_on_stderr_as_they_happen(
    capsys: pytest.CaptureFixture[str], client: WorkspaceClient, server: TestServer
) -> None:
    release = asyncio.Event()

    async def held(ctx: StageContext) -> Any:
        await release.wait()  # until the test has seen the claim reported
        return ctx.input + 1

    argv = [
        "enqueue", "--workspace", WS, "--stage", "held", "--job-id", "J1", "--input", "41",
        "--wait", "--timeout", "60", "--progress", "--url", url_of(server),
        "--token", token_for(WS),
    ]  # fmt: skip
    async with running(Worker(client, {"held": held}, worker_id="w1", config=FAST)):
        command = asyncio.create_task(asyncio.to_thread(workspace_main, argv))
        err = ""
        async with asyncio.timeout(30):
            while "claimed by w1" not in err:
                await asyncio.sleep(0.02)
                err += capsys.readouterr().err
        assert not command.done()  # seen while the stage still runs: as it happened
        release.set()
        code = await command
    out, rest = capsys.readouterr()
    err += rest
    assert code == 0
    answer = json.loads(out)  # stdout: the answer alone
    assert answer["result"] == 42
    rid = answer["request_id"]
    lines = err.splitlines()
    assert lines[0] == f"cv-workspace: {rid} queued"
    assert lines[1].startswith(f"cv-workspace: {rid} claimed by w1 (attempt 1 of ")
    assert lines[2].startswith(f"cv-workspace: {rid} done in ")
    assert len(lines) == 3


async def test_without_progress_stderr_stays_empty(
    capsys: pytest.CaptureFixture[str], client: WorkspaceClient, server: TestServer
) -> None:
    async def quick(ctx: StageContext) -> Any:
        return 1

    async with running(Worker(client, {"quick": quick}, config=FAST)):
        for flag in ([], ["--no-progress"]):
            argv = [
                "enqueue", "--workspace", WS, "--stage", "quick", "--wait", *flag,
                "--url", url_of(server), "--token", token_for(WS),
            ]  # fmt: skip
            assert await asyncio.to_thread(workspace_main, argv) == 0
            assert capsys.readouterr().err == ""


async def test_a_bulk_listing_reports_its_count(
    capsys: pytest.CaptureFixture[str], client: WorkspaceClient, server: TestServer
) -> None:
    for i in range(5):
        await client.enqueue(WS, stage="nobody", job_id=f"J{i}")
    argv = [
        "requests", "list", "--workspace", WS, "--all", "--limit", "2", "--progress",
        "--url", url_of(server), "--token", token_for(WS),
    ]  # fmt: skip
    assert await asyncio.to_thread(workspace_main, argv) == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out)["requests"]) == 5
    assert err == "cv-workspace: fetched 5 requests\n"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_count_is_rewritten_in_place() -> None:
    stream = _Terminal()
    progress = Progress(True, stream)
    progress.count("fetched 2 requests")
    progress.count("fetched 4 requests")
    progress.done("fetched 5 requests")
    assert stream.getvalue() == (
        "\r\x1b[2Kcv-workspace: fetched 2 requests"
        "\r\x1b[2Kcv-workspace: fetched 4 requests"
        "\r\x1b[2Kcv-workspace: fetched 5 requests\n"
    )
