"""`LocalServer`: a real `cv-server` process for an app's tests, on a temporary SQLite file (or a
PostgreSQL URL) and a free loopback port, with tokens minted on demand (docs/client.md,
"Testing your app").

It runs the `cv-server` command the `server` extra installs and never imports the server
package: the SDK and the server meet on the wire only (docs/architecture.md). Every step is
bounded: the start by `start_timeout` (the process is killed and its stderr reported if it has
not answered `/readyz` by then), the stop by `stop_timeout` (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self, TypeVar
from urllib.parse import urlsplit

from cv_workspace_client.errors import WorkspaceError
from cv_workspace_client.testing._commands import (
    Backend,
    SettingValue,
    child_environment,
    listening_url,
    serve_args,
    token_args,
)

__all__ = ["LocalServer", "LocalServerError"]

_T = TypeVar("_T")


class LocalServerError(WorkspaceError):
    """`cv-server` did not start, answer, or mint a token within its bound. `stderr` holds
    what the process wrote there (the message ends with it too): a bad setting, a database it
    cannot open, a missing extra."""

    def __init__(self, message: str, *, stderr: str = "") -> None:
        shown = f"{message}\n--- cv-server stderr ---\n{stderr.rstrip()}" if stderr else message
        super().__init__("local_server_failed", shown)
        self.stderr = stderr


def find_cv_server() -> list[str]:
    """The `cv-server` command: the one installed beside this Python (its virtualenv's), else
    the first on PATH.

    Raises:
        LocalServerError: if there is none (the `server` extra is not installed).
    """
    beside = Path(sys.executable).parent / "cv-server"
    found = str(beside) if beside.exists() else shutil.which("cv-server")
    if found is None:
        raise LocalServerError(
            "no cv-server command beside this Python or on PATH (the server extra):"
            f" {sys.executable} -m pip install 'cv-workspace[server]'"
        )
    return [found]


class LocalServer:
    """A `cv-server serve` process of its own, for one test or one test session.

    ```python
    async with LocalServer() as server:            # or `with LocalServer() as server:`
        async with WorkspaceClient(server.url, token=server.token("ws1")) as client: ...
    ```

    Args:
        directory: where the SQLite file (`cv.db`) and the server's log (`server.log`) go;
            created if missing and kept. Without one, a temporary directory removed at stop.
        database_url: serve from this PostgreSQL database instead (the `postgres` extra);
            `schema` names an existing schema in it. A deployment there is shared with whatever
            else uses it: give each test run a schema of its own.
        settings: `ServerConfig` overrides, each passed as `--set NAME=VALUE`
            (`{"lease_seconds": 5}`; every setting is in docs/configuration.md).
        command: the `cv-server` command to run (default: `find_cv_server()`).
        start_timeout: seconds for the process to listen and answer `/readyz`, and for each
            `token()` call.
        stop_timeout: seconds between SIGTERM and SIGKILL at stop.
        log_level: the server's `--log-level`.

    `CV_*` variables of the environment are not passed on: the harness's flags alone configure
    the process.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        database_url: str | None = None,
        schema: str | None = None,
        settings: Mapping[str, SettingValue] | None = None,
        command: Sequence[str] | None = None,
        start_timeout: float = 30.0,
        stop_timeout: float = 10.0,
        log_level: str = "INFO",
    ) -> None:
        self._directory = Path(directory) if directory is not None else None
        self._database_url = database_url
        self._schema = schema
        self._settings = dict(settings or {})
        self._command = list(command) if command is not None else None
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._log_level = log_level
        self._owned_directory: Path | None = None
        self._backend: Backend | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._log_path: Path | None = None
        self._url: str | None = None
        self._tokens: dict[tuple[str, ...], str] = {}
        self._lock = threading.Lock()
        #: True when the last stop had to SIGKILL the process (it outlived `stop_timeout`).
        self.killed = False

    # -- what a test reads ----------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The server's base URL (`http://127.0.0.1:PORT`).

        Raises:
            RuntimeError: if the server is not started.
        """
        if self._url is None:
            raise RuntimeError("LocalServer is not started: `with` or `async with` it first")
        return self._url

    @property
    def pid(self) -> int | None:
        """The process id while it runs (or ran), else None."""
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        """The process's exit status once it has ended (`-9` after a SIGKILL), else None."""
        return self._proc.poll() if self._proc is not None else None

    @property
    def database(self) -> Path | None:
        """The SQLite file served (None with a `database_url`, or before the start)."""
        return self._backend.db if self._backend is not None else None

    @property
    def log_path(self) -> Path | None:
        """The file the server's stderr goes to (its log), once started."""
        return self._log_path

    def log(self) -> str:
        """What the server has written to stderr so far (its log lines)."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        return self._log_path.read_text(encoding="utf-8", errors="replace")

    # -- tokens ---------------------------------------------------------------------------------

    def token(self, *workspaces: str, ttl: float | None = None) -> str:
        """A bearer token granting `workspaces` (`"*"`: every workspace), minted by
        `cv-server token`; one without `ttl` is minted once per set of workspaces and reused.

        It runs a process (about half a second the first time): call it before the clients
        that need it start, or from a thread (`await asyncio.to_thread(server.token, "ws1")`)
        where the event loop must not stall.

        Raises:
            LocalServerError: if `cv-server token` fails or outlives `start_timeout`.
            ValueError: if no workspace is named.
        """
        backend = self._started_backend()
        key = tuple(sorted(set(workspaces)))
        if ttl is None:
            with self._lock:
                if key in self._tokens:
                    return self._tokens[key]
        argv = [*self._resolved_command(), *token_args(backend, key, ttl)]
        try:
            done = subprocess.run(
                argv,
                capture_output=True,
                timeout=self.start_timeout,
                env=child_environment(os.environ),
                stdin=subprocess.DEVNULL,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            stderr = _text(exc.stderr)
            raise LocalServerError(
                f"cv-server token took over {self.start_timeout} s", stderr=stderr
            ) from None
        if done.returncode != 0:
            raise LocalServerError(
                f"cv-server token exited with status {done.returncode}", stderr=_text(done.stderr)
            )
        token = _text(done.stdout).strip()
        if ttl is None:
            with self._lock:
                self._tokens[key] = token
        return token

    # -- start and stop -------------------------------------------------------------------------

    def start(self) -> None:
        """Start `cv-server serve` and return once it answers `/readyz`; `url` is then set.

        After calling this method: call `stop()` (or use `with`), even if a test fails.

        Raises:
            LocalServerError: if the process exited, printed no listening line, or did not
                answer within `start_timeout` (it is killed; the error carries its stderr).
            RuntimeError: if it is already started.
        """
        if self._proc is not None:
            raise RuntimeError("LocalServer is already started")
        deadline = time.monotonic() + self.start_timeout
        command = self._resolved_command()
        directory = self._prepare_directory()
        backend = Backend(
            db=None if self._database_url else directory / "cv.db",
            database_url=self._database_url,
            schema=self._schema,
        )
        self._backend = backend
        self._log_path = directory / "server.log"
        self._log_file = self._log_path.open("ab")
        self.killed = False
        argv = [*command, *serve_args(backend, settings=self._settings, log_level=self._log_level)]
        try:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=self._log_file,
                env=child_environment(os.environ),
            )
        except OSError as exc:
            self._close_files()
            self._remove_owned_directory()
            raise LocalServerError(f"cannot run {argv[0]}: {exc}") from exc
        try:
            url = self._read_listening_url(deadline)
            self._wait_ready(url, deadline)
        except BaseException:
            self._kill()
            self._remove_owned_directory()  # the error carries the log
            raise
        self._url = url

    def stop(self) -> None:
        """SIGTERM the server and wait `stop_timeout` for it to drain and exit, then SIGKILL it
        (`killed` says which it took). Idempotent; removes the temporary directory, if it made
        one. Call `log()` before, if you want the log of a temporary directory."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self._kill()
        self._close_files()
        self._url = None
        self._tokens.clear()
        self._remove_owned_directory()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        # The blocking steps run in a thread, so the event loop runs on while the server starts.
        await _in_thread(self.start, undo=self.stop)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await _in_thread(self.stop)

    # -- the parts ------------------------------------------------------------------------------

    def _resolved_command(self) -> list[str]:
        if self._command is None:
            self._command = find_cv_server()
        return self._command

    def _started_backend(self) -> Backend:
        if self._backend is None or self._url is None:
            raise RuntimeError("LocalServer is not started: `with` or `async with` it first")
        return self._backend

    def _prepare_directory(self) -> Path:
        if self._directory is not None:
            self._directory.mkdir(parents=True, exist_ok=True)
            return self._directory
        self._owned_directory = Path(tempfile.mkdtemp(prefix="cv-server-"))
        return self._owned_directory

    def _remove_owned_directory(self) -> None:
        if self._owned_directory is not None:
            shutil.rmtree(self._owned_directory, ignore_errors=True)
            self._owned_directory = None

    def _read_listening_url(self, deadline: float) -> str:
        """The URL of the first stdout line, read within `deadline`: `serve` prints it once it
        accepts connections (tests/client/testing/test_local_server.py pins the failures)."""
        proc = self._proc
        assert proc is not None
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        buffered = b""
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while b"\n" not in buffered:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._failure(f"no listening line within {self.start_timeout} s")
                if not selector.select(remaining):
                    continue
                chunk = os.read(fd, 4096)
                if not chunk:
                    code = _wait_briefly(proc)
                    raise self._failure(f"cv-server exited with status {code} before listening")
                buffered += chunk
        line = buffered.split(b"\n", 1)[0].decode("utf-8", "replace")
        url = listening_url(line)
        if url is None:
            raise self._failure(f"cv-server printed {line!r}, not its listening line")
        return url

    def _wait_ready(self, url: str, deadline: float) -> None:
        """`GET /readyz` answers 200 within `deadline`: the stores are open and reachable."""
        parts = urlsplit(url)
        remaining = max(deadline - time.monotonic(), 0.001)
        connection = http.client.HTTPConnection(
            parts.hostname or "127.0.0.1", parts.port, remaining
        )
        try:
            connection.request("GET", "/readyz")
            response = connection.getresponse()
            body = response.read(2048).decode("utf-8", "replace")
        except OSError as exc:
            raise self._failure(f"GET {url}/readyz failed: {exc}") from exc
        finally:
            connection.close()
        if response.status != 200:
            raise self._failure(f"GET {url}/readyz answered {response.status}: {body}")

    def _failure(self, message: str) -> LocalServerError:
        self._kill()  # first, so that everything it wrote is in the log
        return LocalServerError(message, stderr=self.log())

    def _kill(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
            self.killed = True
        self._close_files()

    def _close_files(self) -> None:
        if self._proc is not None and self._proc.stdout is not None:
            self._proc.stdout.close()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def _wait_briefly(proc: subprocess.Popen[bytes]) -> int | None:
    """The exit status of a process whose stdout just closed (it is exiting), else None."""
    try:
        return proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return None


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode("utf-8", "replace")


async def _in_thread(call: Callable[[], _T], undo: Callable[[], object] | None = None) -> _T:
    """`call()` in a thread. A thread cannot be cancelled: on cancellation it is waited for
    (each step of `LocalServer` is bounded), then `undo()` runs, so a start cancelled midway
    leaves no process behind."""
    task = asyncio.ensure_future(asyncio.to_thread(call))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await task
        if undo is not None:
            await asyncio.to_thread(undo)
        raise
