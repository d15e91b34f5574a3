"""Processes of the three-layers acceptance test and benchmark: the server (real `cv-server`, or
the same app with shrunk durations), the counting fake provider endpoint, and `cv-worker`s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import IO, Any

__all__ = ["Proc", "provider_stats", "server_cmd", "worker_cmd"]

STAGES = "cv_workspace_client.stages:STAGES"


class Proc:
    """A child process that announces itself with one stdout line containing `ready`."""

    def __init__(self, args: list[str], log: Path, ready: str) -> None:
        self.args = args
        self.log = log
        self.ready = ready
        self.proc: subprocess.Popen[str] | None = None
        self.banner = ""
        self._log_file: IO[str] | None = None

    def spawn(self) -> Proc:
        self._log_file = self.log.open("a")
        self.proc = subprocess.Popen(
            [sys.executable, *self.args],
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        return self

    def wait_ready(self) -> str:
        """Block until the banner line (EOF — the process died — raises)."""
        assert self.proc is not None
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.args[:3]} exited before it was ready; see {self.log}")
            if self.ready in line:
                self.banner = line.strip()
                return self.banner

    def start(self) -> str:
        return self.spawn().wait_ready()

    @property
    def url(self) -> str:
        """The `http://...` URL in the banner."""
        return next(word for word in self.banner.split() if word.startswith("http://"))

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def server_cmd(db: Path, port: int, **shrunk: float) -> list[str]:
    """The real `cv-server serve`, or (with `shrunk` durations: lease, lock_ttl, backoff) the
    same app through `three_layers_server`."""
    if not shrunk:
        return ["-m", "cv_server.cli", "serve", "--db", str(db), "--port", str(port),
                "--log-level", "WARNING"]  # fmt: skip
    args = ["-m", "tests.acceptance.three_layers_server", "--db", str(db), "--port", str(port)]
    for name, value in shrunk.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    return args


def worker_cmd(
    url: str,
    token: str,
    provider_url: str,
    worker_id: str,
    heartbeat: float,
    stages: str = STAGES,
) -> list[str]:
    """`cv-worker` (through `python -m`: the console script needs a reinstall to appear)."""
    return [
        "-m", "cv_workspace_client.cli", "worker",
        "--url", url, "--token", token,
        "--stages", stages,
        "--provider", "openai", "--provider-url", provider_url, "--model", "fake",
        "--worker-id", worker_id,
        "--heartbeat-seconds", str(heartbeat),
        "--log-level", "WARNING",
    ]  # fmt: skip


def provider_stats(provider_url: str) -> dict[str, Any]:
    """The fake provider's counters (`/stats`, beside its `/v1`)."""
    base = provider_url.rsplit("/v1", 1)[0]
    with urllib.request.urlopen(f"{base}/stats", timeout=10) as response:
        stats: dict[str, Any] = json.loads(response.read())
    return stats
