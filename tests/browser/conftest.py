"""Fixtures of the browser tests: the real server on loopback, and headless Chromium (Debian's
`chromium`, driven by playwright-core through `driver.mjs`; never a browser of its own).

The tests skip when chromium, node or the driver's `node_modules` (`npm ci` in this directory)
are missing, unless `CV_REQUIRE_BROWSER=1` (CI sets it: there a missing browser is an error).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from cv_server import ServerConfig, create_app
from cv_server.auth import mint_token

HERE = Path(__file__).parent
SECRET = b"browser-test-secret-0123456789ab"
WS = "ws1"
#: Bound on starting the browser, and slack added to each command's own timeout.
START_SECONDS = 60.0
SLACK_SECONDS = 30.0

ServerFactory = Callable[..., Any]


def token_for(*workspaces: str) -> str:
    return mint_token(SECRET, list(workspaces), now=time.time())


def _missing() -> str | None:
    if shutil.which("chromium") is None:
        return "Debian's chromium is not installed (apt-get install chromium)"
    if shutil.which("node") is None:
        return "node is not installed"
    if not (HERE / "node_modules" / "playwright-core").is_dir():
        return "playwright-core is not installed (npm ci in tests/browser)"
    return None


class BrowserError(AssertionError):
    """A driver command failed: a wait timed out, a selector matched nothing."""


class Browser:
    """One page in headless Chromium; `call(cmd, **args)` runs a `driver.mjs` command."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    async def _read(self, want: int, seconds: float) -> Any:
        assert self._process.stdout is not None
        async with asyncio.timeout(seconds):
            while True:
                line = await self._process.stdout.readline()
                if not line:
                    raise BrowserError("the browser driver exited")
                message = orjson.loads(line)
                if message["id"] == want:
                    if not message["ok"]:
                        raise BrowserError(message["error"])
                    return message["value"]

    async def call(self, cmd: str, **args: Any) -> Any:
        assert self._process.stdin is not None
        async with self._lock:
            request_id = next(self._ids)
            self._process.stdin.write(orjson.dumps({"id": request_id, "cmd": cmd, **args}) + b"\n")
            await self._process.stdin.drain()
            timeout = args.get("timeout", 0) / 1000 + SLACK_SECONDS
            return await self._read(request_id, timeout)

    async def wait(
        self, selector: str, *, timeout_ms: int = 10_000, state: str = "visible"
    ) -> None:
        await self.call("wait", selector=selector, state=state, timeout=timeout_ms)

    async def problems(self) -> list[str]:
        """Uncaught errors and console errors of the page since the last call."""
        value: list[str] = await self.call("problems")
        return value


@contextlib.asynccontextmanager
async def open_browser(profile: Path) -> AsyncIterator[Browser]:
    """Headless Chromium in `profile`, a fresh directory (made here), closed on exit."""
    await asyncio.to_thread(profile.mkdir, parents=True)
    env = {
        **os.environ,
        "CV_CHROMIUM": str(shutil.which("chromium")),
        "CV_USER_DATA_DIR": str(profile),
    }
    process = await asyncio.create_subprocess_exec(
        "node",
        str(HERE / "driver.mjs"),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=env,
        cwd=HERE,
    )
    browser = Browser(process)
    try:
        assert await browser._read(0, START_SECONDS) == "ready"
        yield browser
    finally:
        with contextlib.suppress(Exception):
            await browser.call("close")
        try:
            await asyncio.wait_for(process.wait(), 30)
        except TimeoutError:
            process.kill()
            await process.wait()


@pytest.fixture
async def browser(server: TestServer, tmp_path: Path) -> AsyncIterator[Browser]:
    """A page in headless Chromium; the test fails if the page logged an error it did not
    collect itself (`Browser.problems`). It needs `server` so that it closes first: a page
    outliving its server logs the failed reconnects of its live stream."""
    missing = _missing()
    if missing is not None:
        if os.environ.get("CV_REQUIRE_BROWSER") == "1":
            pytest.fail(f"CV_REQUIRE_BROWSER=1 but {missing}")
        pytest.skip(missing)
    async with open_browser(tmp_path / "chromium-profile") as browser:
        yield browser
        assert await browser.problems() == []


@pytest.fixture
async def server(aiohttp_server: Callable[..., Any], tmp_path: Path) -> TestServer:
    """The real server on a loopback port, on a SQLite file."""
    app: web.Application = create_app(ServerConfig(db_path=tmp_path / "cv.db", token_secret=SECRET))
    test_server: TestServer = await aiohttp_server(app)
    return test_server


def dashboard_url(server: TestServer, token: str, **fragment: str) -> str:
    """The page, with the token (and the rest) in the fragment, which browsers never send."""
    parts = "&".join(f"{key}={value}" for key, value in {"token": token, **fragment}.items())
    return str(server.make_url("/dashboard")) + "#" + parts
