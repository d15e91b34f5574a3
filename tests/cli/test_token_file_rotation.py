"""`cv-worker --token-file`: a worker must outlive a rotation that a secret manager is in the middle
of when the server refuses the old token."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp.test_utils import TestServer

from cv_workspace_client import WorkspaceClient
from cv_workspace_client.cli.connection import token_file_provider
from cv_workspace_client.stage import StageContext
from cv_workspace_client.worker import Worker, WorkerConfig
from tests.worker.conftest import WS, fast_client_config, token_for, url_of

BOUND = 30.0


async def test_a_token_file_caught_empty_mid_rotation_does_not_stop_the_worker(
    server: TestServer, tmp_path: Path
) -> None:
    """The writer truncated the file and has not written the new token yet when the worker's
    claim is refused. Read once, the empty file failed the refresh, the refused claim stood,
    and the worker stopped (exit 1 for `cv-worker`) in the middle of a rotation going well."""
    token_file = tmp_path / "token"
    token_file.write_text("")  # truncated: the new token is being written
    read_file = token_file_provider(str(token_file))
    calls = 0

    async def provider() -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            # The writer's second step lands a moment after the worker first reads the file.
            loop = asyncio.get_running_loop()
            loop.call_later(0.2, token_file.write_text, token_for(WS) + "\n")
        return await read_file()

    async def echo(ctx: StageContext) -> object:
        return {"echo": ctx.input}

    url = url_of(server)
    async with (
        WorkspaceClient(url, token=token_for(WS), config=fast_client_config()) as app,
        WorkspaceClient(
            url, token="expired-token", token_provider=provider, config=fast_client_config()
        ) as worker_client,
    ):
        worker = Worker(
            worker_client,
            {"echo": echo},
            config=WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05),
        )
        running = asyncio.create_task(worker.run())
        try:
            answer = await app.enqueue(WS, stage="echo", job_id="J1", input=[1])
            outcome = await app.wait_request(WS, answer.request_id, timeout=BOUND)
        finally:
            worker.stop()
            stats = await asyncio.wait_for(running, BOUND)  # raised if the worker stopped
    assert outcome.status == "done"
    assert outcome.result == {"echo": [1]}
    assert stats.clean
    assert calls == 1  # one refresh: the provider read the file again itself
