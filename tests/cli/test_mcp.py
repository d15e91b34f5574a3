"""`cv-workspace mcp` as a process: how it starts, answers and stops (docs/mcp.md). The MCP
server opens no connection to the cv-server before a tool or a subscription needs one, so most
of these run without one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from aiohttp.test_utils import TestServer
from mcp import Client

from tests.acceptance.procs import free_port
from tests.worker.conftest import WS, token_for, url_of

T = TypeVar("T", str, bytes)

#: A URL nothing listens on: nothing here calls it.
URL = f"http://127.0.0.1:{free_port()}"
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "test", "version": "0"},
    },
}


def _mcp(tmp_path: Path, *extra: str, url: str = URL, token: str = "t0ken") -> list[str]:
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    return [
        sys.executable, "-m", "cv_workspace_client.cli", "workspace", "mcp",
        "--url", url, "--token-file", str(token_file), *extra,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("CV_")}


@contextlib.contextmanager
def _killed_on_exit(proc: subprocess.Popen[T]) -> Iterator[subprocess.Popen[T]]:
    """`proc`, killed (if still running) and its pipes closed on the way out: a test that
    failed must not leave it behind, nor hang waiting for it."""
    with proc:
        try:
            yield proc
        finally:
            proc.kill()
            proc.wait(timeout=30)


def _stdio(tmp_path: Path) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    pipe = subprocess.PIPE
    return _killed_on_exit(subprocess.Popen(_mcp(tmp_path), stdin=pipe, stdout=pipe, stderr=pipe))


def _http(
    tmp_path: Path, url: str = URL, token: str = "t0ken"
) -> contextlib.AbstractContextManager[subprocess.Popen[str]]:
    args = _mcp(tmp_path, "--transport", "http", "--port", "0", url=url, token=token)
    pipe = subprocess.PIPE
    return _killed_on_exit(subprocess.Popen(args, stdout=pipe, stderr=pipe, text=True))


def _initialized(proc: subprocess.Popen[bytes]) -> dict[str, object]:
    """Send `initialize` over stdio; the answer (the server is up and speaking MCP)."""
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write(json.dumps(INITIALIZE).encode() + b"\n")
    proc.stdin.flush()
    answer: dict[str, object] = json.loads(proc.stdout.readline())
    return answer


def test_stdio_answers_initialize_and_exits_0_when_the_host_closes_stdin(tmp_path: Path) -> None:
    with _stdio(tmp_path) as proc:
        answer = _initialized(proc)
        assert proc.stdin is not None
        proc.stdin.close()
        code = proc.wait(timeout=30)
        assert proc.stdout is not None
        rest = proc.stdout.read()
    assert code == 0
    result = answer["result"]
    assert isinstance(result, dict)
    assert result["serverInfo"]["name"] == "cv-workspace"
    assert result["capabilities"]["resources"]["subscribe"] is True
    assert rest == b""  # nothing but the protocol on stdout


def test_stdio_stops_on_sigterm_while_the_host_keeps_stdin_open(tmp_path: Path) -> None:
    # The `mcp` SDK reads stdin in a worker thread a cancel cannot interrupt: SIGTERM left the
    # process blocked in that read until the host wrote again or closed the pipe.
    with _stdio(tmp_path) as proc:
        _initialized(proc)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        assert proc.stderr is not None
        errors = proc.stderr.read()
    assert code == 128 + signal.SIGTERM
    assert b"Traceback" not in errors


def test_http_prints_its_url_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    with _http(tmp_path) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        assert proc.stderr is not None
        errors = proc.stderr.read()
    assert line.startswith("cv-workspace mcp listening on http://127.0.0.1:")
    assert line.rstrip().endswith("/mcp")
    assert code == 0
    assert "Traceback" not in errors


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--url (or $CV_URL) is required"),
        (["--url", URL], "--token, $CV_TOKEN, --token-file or $CV_TOKEN_FILE is required"),
        (["--url", URL, "--token", "t", "--transport", "http", "--port", "70000"], "--port"),
        (["--url", URL, "--token", "t", "--transport", "smoke"], "invalid choice"),
    ],
)
def test_bad_arguments_are_usage_errors(args: list[str], message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cv_workspace_client.cli", "workspace", "mcp", "--json", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
        check=False,
    )
    assert out.returncode == 2
    assert out.stdout == ""
    assert message in json.loads(out.stderr)["error"]["message"]


async def test_http_on_sigterm_ends_open_listen_streams_gracefully(
    tmp_path: Path, server: TestServer
) -> None:
    # A listen stream never ends by itself: a server stopping must end it (the client sees a
    # graceful close), not sit out its drain deadline and then drop it.
    with _http(tmp_path, url=url_of(server), token=token_for(WS)) as proc:
        assert proc.stdout is not None
        url = proc.stdout.readline().split()[-1]
        async with (
            Client(url, read_timeout_seconds=30) as client,
            client.listen(resource_subscriptions=[f"cv://{WS}/docs/notes"]) as stream,
        ):
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(30):
                events = [event async for event in stream]
        code = await asyncio.to_thread(proc.wait, 30)
    assert events == []
    assert code == 0


def test_http_on_a_port_in_use_says_so_and_exits_1(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [*_mcp(tmp_path, "--transport", "http", "--port", str(port)), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert out.returncode == 1
    assert out.stdout == ""
    error = json.loads(out.stderr)["error"]
    assert error["code"] == "listen_failed"
    assert f"127.0.0.1:{port}" in error["message"]


def test_stdio_stops_on_sigint_too(tmp_path: Path) -> None:
    with _stdio(tmp_path) as proc:
        _initialized(proc)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
        assert proc.stderr is not None
        errors = proc.stderr.read()
    assert code == 128 + signal.SIGINT
    assert b"Traceback" not in errors


def test_stdio_drops_a_message_past_the_bound_and_answers_the_next(tmp_path: Path) -> None:
    huge = {"jsonrpc": "2.0", "id": 0, "method": "ping", "params": {"pad": "x" * (5 << 20)}}
    with _stdio(tmp_path) as proc:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(huge).encode() + b"\n")
        answer = _initialized(proc)
        proc.stdin.close()
        code = proc.wait(timeout=30)
        assert proc.stderr is not None
        errors = proc.stderr.read()
    assert answer["id"] == 1  # the huge one got no answer; the server went on
    assert code == 0
    assert b"dropped" in errors
