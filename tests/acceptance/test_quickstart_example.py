"""The README's SDK example runs as documented against the real server, twice."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.acceptance.procs import ServerProcess, free_port, mint_cli_token

pytestmark = pytest.mark.acceptance

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"


def test_the_quickstart_example_runs_and_a_second_run_carries_on(tmp_path: Path) -> None:
    db = tmp_path / "cv.db"
    token = mint_cli_token(db, "demo")
    server = ServerProcess(db, free_port(), tmp_path / "server.log")
    server.start()
    try:
        runs = [
            subprocess.run(
                [sys.executable, str(EXAMPLE), server.url, token],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            ).stdout
            for _ in range(2)
        ]
    finally:
        server.stop()
    assert "committed at clock 2" in runs[0]
    assert "counter = 1 at clock 2" in runs[0]
    assert "insert answered node_exists" in runs[1]
    assert "counter = 2 at clock 3" in runs[1]
