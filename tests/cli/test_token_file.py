"""`--token-file` / `$CV_TOKEN_FILE`: the token lives in a file a secret manager rotates in place
(a Kubernetes projected token, a Vault agent's sink). `cv-worker` reads it again whenever the
server refuses the token it holds, so a worker outlives its tokens instead of stopping at the
first expiry; `cv-workspace` reads it once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

import cv_server.http.security
from cv_server.auth import mint_token
from cv_workspace_client._queue import requester as api
from cv_workspace_client.cli.conventions import EXIT_USAGE
from cv_workspace_client.cli.workspace import workspace_main
from tests.clocks import SkippingClock
from tests.worker.conftest import SECRET, WS, token_for, url_of

BOUND = 60.0


async def _workspace(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = await asyncio.to_thread(workspace_main, [*argv, "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out if out.strip() else err)


async def test_the_worker_reads_a_rotated_token_file_when_its_token_expires(
    server: TestServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server judges tokens on the test's clock: the worker's token is good for a minute, the
    # secret manager rotates the file before then, as they do, and then the minute passes at once.
    token_clock = SkippingClock()
    monkeypatch.setattr(cv_server.http.security, "now", token_clock.now)
    expiring = mint_token(SECRET, [WS], now=time.time(), ttl=60)
    token_file = tmp_path / "token"
    token_file.write_text(expiring + "\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cv_workspace_client.cli", "worker",
        "--url", url_of(server), "--token-file", str(token_file),
        "--stages", "tests.worker.cli_stages:STAGES", "--worker-id", "rotating",
        "--log-level", "WARNING",
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "CV_TOKEN": ""},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        ready = await asyncio.wait_for(proc.stdout.readline(), BOUND)
        assert ready.decode().startswith("cv-worker rotating ready")
        token_file.write_text(token_for(WS) + "\n")  # rotated in place
        token_clock.skip(60)  # the old token has expired
        async with api.QueueClient(url_of(server), token_for(WS)) as qc:
            answer = await qc.enqueue(WS, stage="double", job_id="J1", input=21)
            done = await qc.wait_request(WS, answer.request_id, timeout=BOUND)
        assert proc.returncode is None  # it did not stop on the refusal of the old token
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), BOUND)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code == 0
    assert done.status == "done"
    assert done.result == 42
    assert done.request is not None
    assert done.request.claimed_by == "rotating"


async def test_the_workspace_command_reads_its_token_from_the_file(
    capsys: pytest.CaptureFixture[str],
    server: TestServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CV_TOKEN", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text(token_for(WS) + "\n")
    code, answer = await _workspace(
        capsys,
        "enqueue", "--workspace", WS, "--stage", "double", "--job-id", "J1",
        "--url", url_of(server), "--token-file", str(token_file),
    )  # fmt: skip
    assert code == 0, answer
    assert answer["request_id"].startswith("d_")
    monkeypatch.setenv("CV_TOKEN_FILE", str(token_file))
    code, listed = await _workspace(
        capsys, "requests", "list", "--workspace", WS, "--url", url_of(server)
    )
    assert code == 0, listed


@pytest.mark.parametrize(
    ("content", "extra", "says"),
    [
        (None, [], "cannot be read"),
        ("two words\n", [], "does not hold a bearer token"),
        ("fine-token\n", ["--token", "other"], "not both"),
    ],
    ids=["missing", "not-a-token", "both"],
)
async def test_a_token_file_that_cannot_serve_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
    server: TestServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    content: str | None,
    extra: list[str],
    says: str,
) -> None:
    monkeypatch.delenv("CV_TOKEN", raising=False)
    token_file = tmp_path / "token"
    if content is not None:
        token_file.write_text(content)
    code, error = await _workspace(
        capsys,
        "requests", "list", "--workspace", WS, "--url", url_of(server),
        "--token-file", str(token_file), *extra,
    )  # fmt: skip
    assert code == EXIT_USAGE
    assert says in error["error"]["message"]
    assert "two words" not in error["error"]["message"]  # a token is never quoted back
