"""docs/stages.md, run as written: its stage file is `examples/summarize.py` (verbatim), two real
`cv-worker` processes run it from that directory against a real server and the counting fake
provider, and two requests racing for one note's summary pay for one call."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.procs import ServerProcess, free_port, mint_cli_token

pytestmark = pytest.mark.acceptance

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TEXT = "Each op is applied once."


def test_the_tutorial_shows_the_example_file_verbatim() -> None:
    doc = (REPO / "docs" / "stages.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.DOTALL)
    assert (EXAMPLES / "summarize.py").read_text() in blocks


def _start(args: list[str], cwd: Path, log: Path, ready: str) -> subprocess.Popen[str]:
    with log.open("w") as stderr:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=stderr, text=True
        )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded: the process prints it or dies (EOF)
    assert ready in line, (line, log.read_text())
    return proc


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


@pytest.fixture
def running(tmp_path: Path) -> Iterator[tuple[str, Path, str]]:
    """A server, the fake provider and two workers on the tutorial's stage: (url, token file,
    provider url)."""
    db = tmp_path / "cv.db"
    token_file = tmp_path / "token"
    token_file.write_text(mint_cli_token(db, "demo"))
    server = ServerProcess(db, free_port(), tmp_path / "server.log")
    server.start()
    procs: list[subprocess.Popen[str]] = []
    try:
        provider_port = free_port()
        procs.append(
            _start(
                # Each call takes 3 s: the second request is claimed while the first one's call is
                # still in flight, so the two race for the summary.
                [
                    "-m",
                    "cv_workspace_client.stages.fake_provider",
                    "--port",
                    str(provider_port),
                    "--delay",
                    "3",
                ],
                tmp_path,
                tmp_path / "provider.log",
                "fake provider listening",
            )
        )
        provider = f"http://127.0.0.1:{provider_port}"
        for n in range(2):
            procs.append(
                _start(
                    ["-m", "cv_workspace_client.cli", "worker", "--url", server.url,
                     "--token-file", str(token_file), "--stages", "summarize:STAGES",
                     "--worker-id", f"w{n}", "--provider", "openai",
                     "--provider-url", f"{provider}/v1", "--model", "any"],
                    EXAMPLES,
                    tmp_path / f"worker{n}.log",
                    f"cv-worker w{n} ready",
                )
            )  # fmt: skip
        yield server.url, token_file, provider
    finally:
        _stop(procs)
        server.stop()


def _cli(url: str, token_file: Path, *args: str) -> tuple[int, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "cv_workspace_client.cli", "workspace", *args,
         "--url", url, "--token-file", str(token_file)],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    return done.returncode, json.loads(done.stdout or done.stderr)


def test_two_requests_racing_for_one_summary_pay_for_one_call(
    running: tuple[str, Path, str],
) -> None:
    url, token_file, provider = running
    ids = []
    for branch in ("first", "second"):  # two requests (two branches), enqueued before any runs
        code, answer = _cli(
            url, token_file, "enqueue", "--workspace", "demo", "--stage", "summarize",
            "--job-id", "note-1", "--branch-path", branch, "--input", json.dumps({"text": TEXT}),
        )  # fmt: skip
        assert code == 0, answer
        ids.append(answer["request_id"])
    results = []
    for request_id in ids:
        code, answer = _cli(url, token_file, "requests", "wait", "--workspace", "demo", request_id)
        assert (code, answer["status"]) == (0, "done"), answer
        results.append(answer["result"])
    with urllib.request.urlopen(f"{provider}/stats", timeout=10) as resp:
        stats = json.load(resp)
    summaries = {result["summary"] for result in results}
    assert stats["calls"] == 1
    assert sorted(result["computed"] for result in results) == [False, True]
    assert len(summaries) == 1
    assert None not in summaries

    code, answer = _cli(
        url, token_file, "enqueue", "--workspace", "demo", "--stage", "summarize",
        "--job-id", "note-2", "--wait",
    )  # fmt: skip
    assert code == 1
    assert answer["error"]["code"] == "invalid_input"
    assert answer["request"]["dequeue_count"] == 1  # an answer: never retried
