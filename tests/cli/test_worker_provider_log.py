"""`cv-worker --provider openai --model M` says which model it calls: its start line names the
stages, the provider and M, and every `provider_call` line carries M, the model the endpoint
received, even though the shipped stages call `provider.complete(prompt)` without naming one."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

import pytest
from aiohttp import web
from pytest_aiohttp import AiohttpServer

from cv_workspace_client._queue import requester as api
from tests.worker.conftest import WS, MakeServer, token_for, url_of


class Endpoint:
    """An OpenAI-compatible endpoint on loopback that answers at once and keeps each call's
    `model`."""

    def __init__(self) -> None:
        self.models: list[str] = []
        self.base_url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.models.append((await request.json())["model"])
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": "7"}}]})


@pytest.fixture
async def endpoint(aiohttp_server: AiohttpServer) -> Endpoint:
    fake = Endpoint()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.handle)
    test_server = await aiohttp_server(app, host="127.0.0.1")
    fake.base_url = str(test_server.make_url("/v1"))
    return fake


async def test_the_worker_logs_the_model_it_was_started_with_at_start_and_on_each_call(
    make_server: MakeServer, endpoint: Endpoint
) -> None:
    server = await make_server()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cv_workspace_client.cli", "worker",
        "--url", url_of(server), "--token", token_for(WS),
        "--stages", "cv_workspace_client.stages:STAGES", "--worker-id", "w-model",
        "--provider", "openai", "--provider-url", endpoint.base_url, "--model", "any",
        "--log-format", "json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        ready = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
        assert ready["event"] == "ready"
        async with api.QueueClient(url_of(server), token_for(WS)) as queue:
            answer = await queue.enqueue(
                WS, stage="evaluate", job_id="J1", input={"columns": ["fit"]}
            )
            done = await queue.wait_request(WS, answer.request_id, timeout=60)
        assert done.ok, done
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err
    records: list[dict[str, Any]] = [json.loads(line) for line in err.decode().splitlines()]
    started = [r for r in records if r.get("event") == "worker_started"]
    assert len(started) == 1, records
    assert started[0]["provider"] == "openai"
    assert started[0]["model"] == "any"
    assert started[0]["worker"] == "w-model"
    assert "evaluate" in started[0]["stages"]
    calls = [r for r in records if r.get("event") == "provider_call"]
    assert [r["model"] for r in calls] == ["any"]
    assert endpoint.models == ["any"]
