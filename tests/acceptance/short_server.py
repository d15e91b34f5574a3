"""`cv-server serve` with the queue's durations shortened, for acceptance tests: the real server
(`create_app`, run exactly as `cv_server.cli` runs it) with a test-sized `ServerConfig`.

Usage: python -m tests.acceptance.short_server --db PATH --port P [--lease-seconds S]
           [--failure-backoff-seconds S] [--waiter-deadline-seconds S] [--sweep-seconds S]

(`cv-server serve` has no flags for these durations; they stay configurable through
`ServerConfig`, which is what this module sets.)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

from cv_server.cli import _serve
from cv_server.config import ServerConfig

__all__ = ["ShortServer"]


def main(argv: list[str] | None = None) -> int:
    defaults = ServerConfig()
    parser = argparse.ArgumentParser(prog="short_server")
    parser.add_argument("--db", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--lease-seconds", type=float, default=defaults.lease_seconds)
    parser.add_argument(
        "--failure-backoff-seconds", type=float, default=defaults.failure_backoff_seconds
    )
    parser.add_argument(
        "--waiter-deadline-seconds", type=float, default=defaults.waiter_deadline_seconds
    )
    parser.add_argument("--sweep-seconds", type=float, default=defaults.sweep_seconds)
    args = parser.parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(message)s")
    config = ServerConfig(
        db_path=args.db,
        lease_seconds=args.lease_seconds,
        failure_backoff_seconds=args.failure_backoff_seconds,
        waiter_deadline_seconds=args.waiter_deadline_seconds,
        sweep_seconds=args.sweep_seconds,
    )
    asyncio.run(_serve(config, "127.0.0.1", args.port))
    return 0


class ShortServer:
    """The short-lease server as a child process on a fixed loopback port."""

    def __init__(self, db: Path, port: int, log: Path, **durations: float) -> None:
        self.db = db
        self.port = port
        self.log = log
        self.durations = durations
        self.proc: subprocess.Popen[str] | None = None
        self._log_file: IO[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._log_file = self.log.open("a")
        args = ["--db", str(self.db), "--port", str(self.port)]
        for name, value in self.durations.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.acceptance.short_server", *args],
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # blocks until the server says it is listening
        if "listening on" not in line:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r}; see {self.log}")

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=30)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


if __name__ == "__main__":
    raise SystemExit(main())
