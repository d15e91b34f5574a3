"""The server's own `/openapi.json`, as a user's tool reads it: fetched from a real server on
loopback (the one `cv-server serve` runs: `ServerRunner`), written to a file."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from tests.server.wire import Served

#: Node tools asked to stay off the network: the suite talks to 127.0.0.1 only.
QUIET_NODE_ENV = {"REDOCLY_TELEMETRY": "off", "REDOCLY_SUPPRESS_UPDATE_NOTICE": "true"}


@dataclass(frozen=True)
class Ran:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        """Everything the tool printed, for assertions and failure messages."""
        return self.stdout + self.stderr


async def fetch_document(server: Served, into: Path) -> Path:
    """`GET /openapi.json` of `server`, written to `into` / openapi.json."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{server.port}/openapi.json") as answer,
    ):
        assert answer.status == 200
        text = await answer.text()
    path = into / "openapi.json"
    path.write_text(text, encoding="utf-8")
    return path


async def run(argv: Sequence[str | Path], *, cwd: Path, env: dict[str, str] | None = None) -> Ran:
    """Run a tool to its end without blocking the event loop (the server runs on it)."""
    proc = await asyncio.create_subprocess_exec(
        *map(str, argv),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **QUIET_NODE_ENV, **(env or {})},
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=240)
    assert proc.returncode is not None
    return Ran(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))
