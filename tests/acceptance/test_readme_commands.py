"""README commands that must behave as documented on a fresh machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.acceptance.procs import ServerProcess, free_port, mint_cli_token

pytestmark = pytest.mark.acceptance

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "quickstart.py"


def test_the_readme_runs_the_example_this_file_checks() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "python examples/quickstart.py URL TOKEN" in readme
    assert "./scripts/serve" in readme


def _quickstart(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_quickstart_without_an_answer_keeps_its_first_op_pending_instead_of_crashing(
    tmp_path: Path,
) -> None:
    # A token the server refuses (here: one minted for another database, the mistake of pasting
    # a token from an earlier `./scripts/serve`) is no answer about the op: the example's very
    # first op, the insert, gets StillPendingError. The example handled that only around the
    # increment, so a run with no answer died with a traceback instead of saying the op waits.
    db = tmp_path / "cv.db"
    token = mint_cli_token(db, "demo")
    foreign_token = mint_cli_token(tmp_path / "other.db", "demo")
    server = ServerProcess(db, free_port(), tmp_path / "server.log")
    server.start()
    try:
        refused = _quickstart(server.url, foreign_token, cwd=tmp_path)
        carried_on = _quickstart(server.url, token, cwd=tmp_path)
    finally:
        server.stop()
    assert refused.returncode == 0, refused.stderr
    assert "Traceback" not in refused.stderr
    assert "stays pending in the outbox" in refused.stdout
    assert "unauthorized" in refused.stdout
    # The next run (a good token) replays the pending insert first, under its op_id: its own
    # insert then finds the node, and the counter starts at 1, right after the replayed insert.
    assert carried_on.returncode == 0, carried_on.stderr
    assert "insert answered node_exists" in carried_on.stdout
    assert "counter = 1 at clock 2" in carried_on.stdout


@pytest.mark.parametrize("args", [[], ["http://127.0.0.1:8080"]], ids=["no-arguments", "no-token"])
def test_quickstart_without_its_arguments_prints_its_usage_and_exits_2(
    tmp_path: Path, args: list[str]
) -> None:
    run = _quickstart(*args, cwd=tmp_path)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert run.stderr.startswith("usage: python examples/quickstart.py [-h] URL TOKEN")
    assert list(tmp_path.iterdir()) == []  # nothing started, no outbox created
