"""A deterministic re-enqueue after its finished row was deleted (docs/queue.md, "How long a
finished request is kept"): the stage runs again, and the compute lock's pre-flight check, which
finds the value the first run wrote, keeps the expensive call from repeating."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestServer

from cv_server import ServerConfig, create_app
from cv_server.keys import STORES
from cv_server.reaper import batches, reap_once
from cv_workspace_client._queue import requester as api
from cv_workspace_client.stage import StageContext
from cv_workspace_client.stages import evaluate
from cv_workspace_client.testing import CountingFakeProvider
from cv_workspace_client.worker import Worker, WorkerConfig
from tests.worker.conftest import SECRET, WS, ServerFactory, open_client, running

COLUMNS = ["fit", "seniority", "remote"]
FAST = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05)
#: Short enough that a row finished before the purge is past it, on the queue's clock.
RETENTION = 0.001


async def test_a_re_enqueue_after_the_row_was_deleted_runs_again_without_paying_again(
    aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    config = ServerConfig(
        db_path=tmp_path / "cv.db", token_secret=SECRET, request_retention_seconds=RETENTION
    )
    server: TestServer = await aiohttp_server(create_app(config))
    assert server.app is not None
    stores = server.app[STORES]
    provider = CountingFakeProvider()
    runs: list[str] = []

    async def counted_evaluate(ctx: StageContext) -> Any:
        runs.append(ctx.request.request_id)
        return await evaluate(ctx)

    body = {"stage": "evaluate", "job_id": "J1", "input": {"columns": COLUMNS}}
    async with open_client(server) as client:
        worker = Worker(client, {"evaluate": counted_evaluate}, provider=provider, config=FAST)
        async with running(worker):
            first = await api.enqueue(client, WS, body)
            done = await api.wait_request(client, WS, first.request_id, timeout=30)
            assert (done.status, provider.calls, len(runs)) == ("done", 3, 1)
            assert done.result is not None
            assert done.result["computed"] == COLUMNS

            # Within the retention: answered by the finished row, nothing runs.
            again = await api.enqueue(client, WS, body)
            assert (again.request_id, again.coalesced, again.status) == (
                first.request_id,
                True,
                "done",
            )

            report = await reap_once(batches(stores, config), 100)
            assert report.deleted["requests"] == 1
            assert await stores.queue.get(WS, first.request_id) is None

            # After it: the same id is a new request, and the stage runs again...
            fresh = await api.enqueue(client, WS, body)
            assert (fresh.request_id, fresh.coalesced) == (first.request_id, False)
            rerun = await api.wait_request(client, WS, fresh.request_id, timeout=30)
            assert (rerun.status, len(runs)) == ("done", 2)
            # ...but every cell is found by the pre-flight check: no call is paid again.
            assert rerun.result is not None
            assert rerun.result["computed"] == []
            assert rerun.result["values"] == done.result["values"]
            assert provider.calls == 3
