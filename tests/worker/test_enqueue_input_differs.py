"""An enqueue that coalesces says when the request it joined holds another input (docs/queue.md):
`input_differs: true` on the answer (and in the SDK's `EnqueuedRequest`), a warning naming
`--rerun` from `cv-workspace` — and coalescing goes on."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from cv_server.queue import model
from cv_workspace_client import WorkspaceClient
from cv_workspace_client.cli.workspace import workspace_main
from cv_workspace_client.stage import StageContext
from cv_workspace_client.worker import Worker, WorkerConfig
from tests.worker.conftest import WS, running, token_for, url_of

FAST = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05)


def test_input_differs_compares_canonical_json_type_for_type() -> None:
    req = model.NewRequest(
        workspace_id=WS, stage="s", request_id="d_1", input={"a": 1, "b": [1.0, True]}
    )
    row = model.new_row(req, 1.0)
    reordered = model.NewRequest(WS, "s", "d_1", input={"b": [1.0, True], "a": 1})
    int_for_float = model.NewRequest(WS, "s", "d_1", input={"a": 1, "b": [1, True]})
    assert not model.input_differs(model.Enqueued(row, coalesced=True), reordered)
    assert model.input_differs(model.Enqueued(row, coalesced=True), int_for_float)
    assert not model.input_differs(model.Enqueued(row, coalesced=False), int_for_float)


async def test_a_coalesced_enqueue_says_when_its_input_was_not_used(
    client: WorkspaceClient,
) -> None:
    first = await client.enqueue(WS, stage="s", job_id="J1", input={"v": 1})
    same = await client.enqueue(WS, stage="s", job_id="J1", input={"v": 1})
    other = await client.enqueue(WS, stage="s", job_id="J1", input={"v": 2})
    assert (first.coalesced, first.input_differs) == (False, False)
    assert (same.coalesced, same.input_differs) == (True, False)
    assert (other.coalesced, other.input_differs) == (True, True)
    assert other.request_id == first.request_id  # coalescing goes on
    assert (await client.get_request(WS, first.request_id)).input == {"v": 1}

    async def echo(ctx: StageContext) -> Any:
        return ctx.input

    async with running(Worker(client, {"s": echo}, config=FAST)):
        done = await client.wait_request(WS, first.request_id, 30)
    assert done.result == {"v": 1}
    finished = await client.enqueue(WS, stage="s", job_id="J1", input={"v": 2})
    assert (finished.status, finished.coalesced, finished.input_differs) == ("done", True, True)
    rerun = await client.enqueue(WS, stage="s", job_id="J1", input={"v": 2}, rerun=True)
    assert (rerun.coalesced, rerun.input_differs) == (False, False)


async def test_the_shell_warns_and_names_rerun_when_its_input_was_not_used(
    capsys: pytest.CaptureFixture[str], client: WorkspaceClient, server: TestServer
) -> None:
    await client.enqueue(WS, stage="s", job_id="J1", input={"v": 1})
    argv = ["enqueue", "--workspace", WS, "--stage", "s", "--job-id", "J1", "--input", '{"v": 2}']
    argv += ["--url", url_of(server), "--token", token_for(WS)]
    code = await asyncio.to_thread(workspace_main, [*argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0
    answer = json.loads(out)
    assert (answer["coalesced"], answer["input_differs"]) == (True, True)
    warning = json.loads(err)["warning"]
    assert warning["code"] == "input_differs"
    assert "--rerun" in warning["message"]
    assert answer["request_id"] in warning["message"]
    # Without --json: one line, in the commands' one style.
    code = await asyncio.to_thread(workspace_main, argv)
    out, err = capsys.readouterr()
    assert code == 0
    assert json.loads(out)["input_differs"] is True
    (line,) = err.splitlines()
    assert line.startswith("cv-workspace: warning: ")
    assert line.endswith("(input_differs)")
    assert "--rerun" in line
