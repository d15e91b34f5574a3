"""`cv-workspace schedules` (in a thread, against the in-process server): add, list, show,
pause, resume, run-now and delete as JSON on stdout; a firing's request run by a worker."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from cv_workspace_client import NotFoundError, WorkspaceClient
from cv_workspace_client.cli.conventions import EXIT_FAILED, EXIT_USAGE
from cv_workspace_client.cli.workspace import workspace_main
from cv_workspace_client.stage import StageContext
from cv_workspace_client.worker import Worker, WorkerConfig
from tests.worker.conftest import WS, running, token_for, url_of

FAST = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05)
#: How long a test waits for the scheduler to fire a schedule due every second.
FIRING_DEADLINE = 10.0


async def _cli(
    capsys: pytest.CaptureFixture[str], server: TestServer, *args: str
) -> tuple[int, Any]:
    argv = [*args, "--json", "--url", url_of(server), "--token", token_for(WS)]
    code = await asyncio.to_thread(workspace_main, argv)
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else json.loads(err)


async def _echo(ctx: StageContext) -> Any:
    return {"echo": ctx.input}


async def test_a_schedule_added_from_the_shell_fires_and_a_worker_runs_its_request(
    capsys: pytest.CaptureFixture[str], client: WorkspaceClient, server: TestServer
) -> None:
    code, added = await _cli(
        capsys, server, "schedules", "add", "tick", "--workspace", WS, "--every", "1",
        "--stage", "echo", "--input", '{"n": 7}', "--missed", "all",
    )  # fmt: skip
    assert code == 0
    assert (added["name"], added["interval_seconds"], added["missed"]) == ("tick", 1, "all")
    assert added["enqueue"] == {"stage": "echo", "input": {"n": 7}}
    deadline = time.monotonic() + FIRING_DEADLINE
    schedule = await client.get_schedule(WS, "tick")
    while schedule.last_request_id is None:
        assert time.monotonic() < deadline, "the schedule did not fire"
        await asyncio.sleep(0.1)
        schedule = await client.get_schedule(WS, "tick")
    async with running(Worker(client, {"echo": _echo}, config=FAST)):
        outcome = await client.wait_request(WS, schedule.last_request_id, timeout=30)
    assert outcome.status == "done"
    assert outcome.result == {"echo": {"n": 7}}
    code, paused = await _cli(capsys, server, "schedules", "pause", "--workspace", WS, "tick")
    assert code == 0
    assert paused["paused"] is True


async def test_every_schedules_verb_answers_json(
    capsys: pytest.CaptureFixture[str], client: WorkspaceClient, server: TestServer
) -> None:
    code, _ = await _cli(
        capsys, server, "schedules", "add", "nightly", "--workspace", WS,
        "--cron", "0 3 * * *", "--stage", "invoices", "--paused",
    )  # fmt: skip
    assert code == 0
    code, listed = await _cli(capsys, server, "schedules", "list", "--workspace", WS)
    assert [s["name"] for s in listed["schedules"]] == ["nightly"]
    code, shown = await _cli(capsys, server, "schedules", "show", "--workspace", WS, "nightly")
    assert (shown["cron"], shown["paused"], shown["next_fire_at"]) == ("0 3 * * *", True, None)
    code, resumed = await _cli(capsys, server, "schedules", "resume", "--workspace", WS, "nightly")
    assert resumed["next_fire_at"] % 86_400 == 3 * 3600
    code, ran = await _cli(capsys, server, "schedules", "run-now", "--workspace", WS, "nightly")
    assert code == 0
    assert ran["request_id"].startswith("s_")
    assert (await client.get_request(WS, ran["request_id"])).stage == "invoices"
    code, deleted = await _cli(capsys, server, "schedules", "delete", "--workspace", WS, "nightly")
    assert (code, deleted) == (0, {"deleted": "nightly"})
    code, refused = await _cli(capsys, server, "schedules", "show", "--workspace", WS, "nightly")
    assert code == EXIT_FAILED
    assert refused["error"]["code"] == "schedule_not_found"
    with pytest.raises(NotFoundError):
        await client.get_schedule(WS, "nightly")


async def test_a_schedule_needs_exactly_one_of_cron_and_every(
    capsys: pytest.CaptureFixture[str], server: TestServer
) -> None:
    argv = ["--json", "--url", url_of(server), "--token", token_for(WS)]
    base = ["schedules", "add", "x", "--workspace", WS, "--stage", "s", *argv]

    def exit_code(args: list[str]) -> int:
        try:
            return workspace_main(args)
        except SystemExit as exc:  # argparse's refusals
            return int(exc.code or 0)

    both = await asyncio.to_thread(exit_code, [*base, "--cron", "* * * * *", "--every", "5"])
    neither = await asyncio.to_thread(exit_code, base)
    zero = await asyncio.to_thread(exit_code, [*base, "--every", "0"])
    bad_input = await asyncio.to_thread(exit_code, [*base, "--every", "5", "--input", "{"])
    assert (both, neither, zero, bad_input) == (EXIT_USAGE,) * 4
    capsys.readouterr()
    assert await asyncio.to_thread(exit_code, ["schedules", "list", "--workspace", WS, *argv]) == 0
