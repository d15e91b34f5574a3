"""Running the real `cv-server` process for acceptance tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

__all__ = ["ServerProcess", "create_sqlite_database", "free_port", "mint_cli_token"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def create_sqlite_database(db: Path) -> None:
    """Create the SQLite database `db`, its token secret included (`cv-server init`)."""
    _init(["--db", str(db)])


def _init(backend: list[str]) -> None:
    subprocess.run(
        [sys.executable, "-m", "cv_server.cli", "init", *backend],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )


def mint_cli_token(db: Path | None, workspace: str, *, database_url: str | None = None) -> str:
    """`cv-server token` for the SQLite file `db`, or for the PostgreSQL `database_url` (a
    `search_path` in its query selects the schema). The deployment is set up first where it is
    not yet (`cv-server init`, idempotent): `token` reads the secret of an existing one only."""
    backend = ["--database-url", database_url] if database_url else ["--db", str(db)]
    if database_url or (db is not None and not db.exists()):
        _init(backend)
    out = subprocess.run(
        [sys.executable, "-m", "cv_server.cli", "token", *backend, "--workspace", workspace],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout.strip()


class ServerProcess:
    """`cv-server serve` on a fixed loopback port, so a restart keeps the same URL. With
    `database_url` it serves from PostgreSQL (`db` is then unused and may be None)."""

    def __init__(
        self,
        db: Path | None,
        port: int,
        log: Path,
        *,
        database_url: str | None = None,
        settings: tuple[str, ...] = (),
        entry: tuple[str, ...] = ("-m", "cv_server.cli"),
    ) -> None:
        self.db = db
        #: What runs `cv-server`'s arguments (a test module wrapping it, say).
        self.entry = entry
        self.database_url = database_url
        #: `NAME=VALUE` overrides, each passed as `--set NAME=VALUE`.
        self.settings = settings
        self.port = port
        self.log = log
        self.proc: subprocess.Popen[str] | None = None
        self._log_file: IO[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> None:
        self._close_files()
        self._log_file = self.log.open("a")
        backend = (
            ["--database-url", self.database_url] if self.database_url else ["--db", str(self.db)]
        )
        overrides = [arg for setting in self.settings for arg in ("--set", setting)]
        args = ["serve", *backend, "--port", str(self.port), "--log-level", "WARNING", *overrides]
        self.proc = subprocess.Popen(
            [sys.executable, *self.entry, *args],
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = self.proc.stdout.readline()  # blocks until the server printed it is listening
        if "listening on" not in line or time.monotonic() > deadline:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r}; see {self.log}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._close_files()

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        self._close_files()
        return code

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._close_files()

    def _close_files(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
