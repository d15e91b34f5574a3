"""Structured logs of the real processes: `cv-server serve --log-format json` and `cv-worker
--log-format json`.

- every line either process writes (stdout and stderr, the banner and the shutdown steps
  included) is one JSON object;
- a request sent with `X-Request-ID: abc` is logged with `request_id: "abc"` and answered with
  the header; an invalid one is replaced by a minted id, never logged;
- one stage run is followed by its queue request id from the server's enqueue and claim,
  through the worker's compute-lock decision, provider call and write, to the server's done;
- a bearer token sent on every route never appears in any line of either process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.acceptance.procs import create_sqlite_database, free_port, mint_cli_token

pytestmark = pytest.mark.acceptance

REPO = Path(__file__).resolve().parents[2]
WS = "ws1"


def _env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}


@dataclass
class _Proc:
    proc: subprocess.Popen[str]
    stdout: Path
    stderr: Path

    def lines(self) -> list[str]:
        return [
            line
            for path in (self.stdout, self.stderr)
            if path.exists()
            for line in path.read_text().splitlines()
        ]

    def records(self) -> list[dict[str, Any]]:
        """Every line as JSON: a line that is not one JSON object fails the test."""
        records = []
        for line in self.lines():
            record = json.loads(line)
            assert isinstance(record, dict), line
            records.append(record)
        return records

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def _spawn(args: list[str], tmp: Path, name: str, ready: str) -> _Proc:
    out, err = tmp / f"{name}.out", tmp / f"{name}.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", *args],
            stdout=stdout,
            stderr=stderr,
            text=True,
            cwd=REPO,
            env=_env(),
        )
    spawned = _Proc(proc, out, err)
    for _ in range(6000):  # up to 60 s for the ready line
        if any(ready in line for line in spawned.lines()):
            return spawned
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited {proc.returncode}: {spawned.lines()}")
        time.sleep(0.01)  # polling another process's output, bounded by the loop
    spawned.stop()
    raise AssertionError(f"{name} never printed {ready!r}")


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[tuple[_Proc, str, str]]:
    db = tmp_path / "cv.db"
    create_sqlite_database(db)
    token = mint_cli_token(db, "*")
    port = free_port()
    server = _spawn(
        [
            "cv_server.cli",
            "serve",
            "--db",
            str(db),
            "--port",
            str(port),
            "--log-format",
            "json",
            "--log-level",
            "INFO",
        ],
        tmp_path,
        "server",
        "listening on",
    )
    try:
        yield server, f"http://127.0.0.1:{port}", token
    finally:
        server.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def test_request_ids_a_followed_stage_run_and_no_token_in_any_line(
    deployment: tuple[_Proc, str, str], session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    server, url, token = deployment
    bearer = {"Authorization": f"Bearer {token}"}

    # -- X-Request-ID kept and echoed; an invalid one replaced
    resp = await session.get(
        f"{url}/v1/workspaces/{WS}/docs/tree", headers={**bearer, "X-Request-ID": "abc"}
    )
    assert resp.status == 200
    assert resp.headers["X-Request-ID"] == "abc"
    resp = await session.get(
        f"{url}/v1/workspaces/{WS}/docs/tree", headers={**bearer, "X-Request-ID": "no spaces!"}
    )
    minted = resp.headers["X-Request-ID"]
    assert minted not in ("", "no spaces!")

    # -- a token sent on every route (and in places it does not belong: a query string, a body)
    await _touch_every_route(session, url, token)

    # -- one stage run, followed across the processes by its queue request id
    worker = _spawn(
        [
            "cv_workspace_client.cli",
            "worker",
            "--url",
            url,
            "--token",
            token,
            "--stages",
            "cv_workspace_client.stages:STAGES",
            "--provider",
            "fake",
            "--worker-id",
            "w1",
            "--log-format",
            "json",
        ],
        tmp_path,
        "worker",
        "ready",
    )
    try:
        resp = await session.post(
            f"{url}/v1/workspaces/{WS}/requests",
            json={"stage": "enrich", "job_id": "job-1", "input": {"origin": "home"}},
            headers=bearer,
        )
        assert resp.status == 202, await resp.text()
        run_id = (await resp.json())["request_id"]
        async with asyncio.timeout(60):
            while True:
                resp = await session.get(
                    f"{url}/v1/workspaces/{WS}/requests/{run_id}", headers=bearer
                )
                row = await resp.json()
                if row["status"] == "done":
                    break
                await asyncio.sleep(0.05)
        assert row["error"] is None, row
        assert row["telemetry"]["provider_calls"] == 1
    finally:
        assert worker.stop() == 0
    assert server.stop() == 0

    server_lines, worker_lines = server.records(), worker.records()
    by_id = [r for r in server_lines if r.get("request_id") == "abc"]
    assert len(by_id) == 1
    assert by_id[0]["route"] == "/v1/workspaces/{ws}/docs/{sub_doc}"
    assert by_id[0]["status"] == 200
    assert by_id[0]["workspace"] == WS
    assert by_id[0]["method"] == "GET"
    assert isinstance(by_id[0]["duration_ms"], float)
    assert not any("no spaces!" in json.dumps(r) for r in server_lines)
    assert [r for r in server_lines if r.get("request_id") == minted]
    # startup and shutdown steps, the banner included, each one JSON line
    steps = [r["step"] for r in server_lines if "step" in r]
    for step in ("open_stores", "ready", "listening", "drain", "close_sockets", "stopped"):
        assert step in steps, steps

    server_run = [r["event"] for r in server_lines if r.get("queue_request_id") == run_id]
    assert server_run[:2] == ["queue_enqueued", "queue_claimed"], server_run
    assert server_run[-1] == "queue_done", server_run
    # The worker's HTTP requests of the run carry its id as their X-Request-ID.
    locks = [r for r in server_lines if r.get("request_id") == run_id]
    assert any(r["route"] == "/v1/workspaces/{ws}/locks/acquire" for r in locks), locks
    worker_run = [r["event"] for r in worker_lines if r.get("queue_request_id") == run_id]
    for event in ("run_started", "lock_acquired", "provider_call", "stage_write", "run_done"):
        assert event in worker_run, worker_run
    assert worker_run.index("lock_acquired") < worker_run.index("provider_call")
    # the job's node, then (after the call) the figure it paid for
    last_write = len(worker_run) - 1 - worker_run[::-1].index("stage_write")
    assert worker_run.index("provider_call") < last_write
    writes = [r for r in worker_lines if r.get("event") == "stage_write"]
    assert {r["sub_doc"] for r in writes} == {"jobs"}
    assert all(r["clock"] >= 1 for r in writes)

    for line in server.lines() + worker.lines():
        assert token not in line
        assert token.split(".")[-1] not in line  # not even its signature


async def _touch_every_route(session: aiohttp.ClientSession, url: str, token: str) -> None:
    """Each route once with the token as its bearer; some also with the token where it does
    not belong, so that a log line quoting a path, a query or a body would carry it."""
    bearer = {"Authorization": f"Bearer {token}"}
    rid = "r_" + "0" * 40
    calls: list[tuple[str, str, Any]] = [
        ("GET", "/healthz", None),
        ("GET", "/readyz", None),
        ("GET", "/metrics", None),
        ("GET", f"/v1/workspaces/{WS}/docs/tree", None),
        ("GET", f"/v1/workspaces/{WS}/docs/tree/ops?since=0&token={token}", None),
        ("POST", f"/v1/workspaces/{WS}/docs/tree/ops", {"ops": [{"type": token}]}),
        ("POST", f"/v1/workspaces/{WS}/docs/tree/ops", {"ops": []}),
        ("POST", f"/v1/workspaces/{WS}/requests", {"stage": token[:60], "input": token}),
        ("GET", f"/v1/workspaces/{WS}/requests/{rid}", None),
        ("GET", f"/v1/workspaces/{WS}/requests/{rid}/stream?timeout=0", None),
        ("POST", f"/v1/workspaces/{WS}/requests/{rid}/heartbeat", {"claim_token": token}),
        ("POST", f"/v1/workspaces/{WS}/requests/{rid}/complete", {"claim_token": token}),
        ("POST", f"/v1/workspaces/{WS}/requests/{rid}/fail", {"claim_token": token}),
        ("POST", f"/v1/workspaces/{WS}/requests/{rid}/replay", None),
        ("GET", f"/v1/workspaces/{WS}/blobs/{token}", None),
        ("POST", "/v1/queue/claim", {"worker_classes": ["nobody"], "worker_id": token[:200]}),
        ("POST", "/v1/queue/complete", {"completions": [{"request_id": rid}]}),
        ("GET", "/v1/queue/pending?worker_classes=nobody&timeout=0", None),
        ("GET", "/v1/queue/requests?status=poison", None),
        ("POST", f"/v1/workspaces/{WS}/locks/acquire", {"job_id": "j", "task": "t"}),
        ("POST", f"/v1/workspaces/{WS}/locks/release", {"job_id": "j", "task": "t", "token": "x"}),
        ("GET", "/openapi.json", None),
        ("GET", "/docs", None),
        ("GET", f"/no/such/route/{token}", None),
    ]
    for method, path, body in calls:
        async with session.request(method, url + path, json=body, headers=bearer) as resp:
            assert resp.status < 500, (path, resp.status, await resp.text())
    # the websocket takes its token in the query string (browsers cannot set headers)
    async with session.ws_connect(f"{url}/v1/workspaces/{WS}/socket?token={token}") as ws:
        await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
        assert (await ws.receive_json(timeout=10))["type"] == "synced"
    # and one with a bad token in the header: the refusal must not quote it either
    async with session.get(
        f"{url}/v1/workspaces/{WS}/docs/tree", headers={"Authorization": f"Bearer {token}x"}
    ) as resp:
        assert resp.status == 401
