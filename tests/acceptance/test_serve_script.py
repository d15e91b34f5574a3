"""`./scripts/serve` on a fresh checkout (no `.venv`): it says what it is doing before the
minute it spends building the virtualenv, then serves; and the virtualenv it built runs every
command the README shows, the MCP server (`cv-workspace mcp`, the `mcp` extra) included.

A real bootstrap: a copy of the checkout's files, `python3 -m venv`, pip installing the project
and its extras, the real server. Slow (about a minute), like the first run it stands for."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.acceptance

REPO = Path(__file__).resolve().parents[2]
#: A first run creates the virtualenv and installs into it: minutes on a slow machine.
BOOTSTRAP_SECONDS = 900.0


def _fresh_checkout(into: Path) -> Path:
    """The checkout's files (tracked, and new ones not ignored), without `.venv` or any data."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return into


def _environment() -> dict[str, str]:
    """This shell's environment without the commands' variables (the defaults are the point)
    and without this suite's virtualenv."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CV_", "VIRTUAL_ENV"))}
    env.pop("PYTHONPATH", None)
    return {**env, "PYTHONUNBUFFERED": "1"}


def _serve_until_listening(checkout: Path) -> tuple[subprocess.Popen[str], list[str], str]:
    """Start `./scripts/serve --port 0`; return it, every line it wrote (stdout and stderr, in
    order) up to the `listening on` banner, and the URL of the banner."""
    proc = subprocess.Popen(
        ["./scripts/serve", "--port", "0"],
        cwd=checkout,
        env=_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    # The whole start is bounded: past it the script's process group is killed, its pipe ends
    # and the loop below sees no banner.
    watchdog = threading.Timer(BOOTSTRAP_SECONDS, os.killpg, (proc.pid, signal.SIGKILL))
    watchdog.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            banner = re.search(r"listening on (http://\S+)", line)
            if banner:
                return proc, lines, banner.group(1)
    finally:
        watchdog.cancel()
    proc.wait()
    proc.stdout.close()
    raise AssertionError("./scripts/serve ended without listening:\n" + "\n".join(lines))


def test_a_first_serve_says_what_it_does_then_serves_and_its_venv_runs_the_readme_mcp_step(
    tmp_path: Path,
) -> None:
    checkout = _fresh_checkout(tmp_path / "checkout")
    proc, lines, url = _serve_until_listening(checkout)
    try:
        token_lines = [line for line in lines if line.startswith("token for workspace 'demo': ")]
        assert len(token_lines) == 1, lines
        token = token_lines[0].rsplit(" ", 1)[1]
        # The README's agent step, as its JSON starts it: the MCP server over stdio. The host
        # closing stdin at once ends it, exit 0; without the mcp extra it would be exit 2.
        (checkout / "token").write_text(token + "\n")
        mcp = subprocess.run(
            [".venv/bin/cv-workspace", "mcp", "--outbox", "agent-outbox.db"],
            cwd=checkout,
            env={**_environment(), "CV_URL": url, "CV_TOKEN_FILE": "token"},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "needs the mcp extra" not in mcp.stderr
        assert mcp.returncode == 0, mcp.stderr

        # What the first run printed: the announcement before the silent venv creation, then
        # what pip installs.
        assert lines[0].startswith("setting up .venv"), lines[:5]
        installing = [line for line in lines if line.startswith("installing ")]
        assert installing, lines
        assert "cv-workspace[server,mcp]" in installing[0]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        assert proc.stdout is not None
        proc.stdout.close()
    assert proc.returncode == 0
