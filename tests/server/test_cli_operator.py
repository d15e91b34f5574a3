"""`cv-server` as an operator runs it: piped into a reader that leaves early, given a port or a
log level that cannot work, interrupted while it waits for its database, asked for `--help`.
Real processes, except for `--help`."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from cv_server.cli import main
from tests.acceptance.procs import create_sqlite_database, free_port

EXIT_READER_GONE = 128 + signal.SIGPIPE


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "cv_server.cli", *args]


async def _finish(proc: asyncio.subprocess.Process, within: float = 60) -> tuple[int, str]:
    try:
        _, err = await asyncio.wait_for(proc.communicate(), within)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, (err or b"").decode()


async def _start_with_reader_gone(*args: str) -> asyncio.subprocess.Process:
    """`cv-server ARGS` with a stdout pipe whose reader has already left (as after `| head -1`
    exited): every write to it fails with EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return await asyncio.create_subprocess_exec(
            *_command(*args), stdout=write_end, stderr=asyncio.subprocess.PIPE
        )
    finally:
        os.close(write_end)


async def test_token_piped_into_a_reader_that_left_exits_quietly(tmp_path: Path) -> None:
    """`TOKEN=$(cv-server token ... | head -c 0)`-like pipelines: the print of the token was a
    BrokenPipeError traceback (exit 1)."""
    db = tmp_path / "cv.db"
    await asyncio.to_thread(create_sqlite_database, db)  # `token` reads an existing one only
    proc = await _start_with_reader_gone("token", "--db", str(db), "--workspace", "ws1")
    code, err = await _finish(proc)
    assert err == ""
    assert code == EXIT_READER_GONE


async def test_serve_whose_stdout_reader_left_keeps_serving_and_drains_on_sigterm(
    tmp_path: Path,
) -> None:
    """The "listening on" line is for whoever watches the start; a reader that left before it
    (a `| head -1` that exited) made it a BrokenPipeError traceback, and the server stopped
    before serving a request."""
    port = free_port()
    proc = await _start_with_reader_gone(
        "serve", "--db", str(tmp_path / "cv.db"), "--port", str(port), "--log-level", "WARNING"
    )
    try:
        async with aiohttp.ClientSession() as session, asyncio.timeout(30):
            while True:  # until it answers (a state: the server is up), or it died
                assert proc.returncode is None, await _finish(proc)
                try:
                    async with session.get(f"http://127.0.0.1:{port}/healthz") as answer:
                        if answer.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
    finally:
        code, err = await _finish(proc)
    assert "Traceback" not in err, err
    assert code == 0


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--port", "99999"], "--port"),
        (["--port", "65536"], "--port"),
        (["--port", "-1"], "--port"),
        (["--log-level", "bogus"], "--log-level"),
    ],
)
async def test_a_port_or_log_level_that_cannot_work_is_refused_before_anything_opens(
    tmp_path: Path, args: list[str], named: str
) -> None:
    """`--port 99999` served on port 34463 (99999 - 65536: the bind wrapped it), a port the
    operator never asked for; `--log-level bogus` (or `debug`, lower case) was a ValueError
    traceback from `logging`."""
    db = tmp_path / "cv.db"
    proc = await asyncio.create_subprocess_exec(
        *_command("serve", "--db", str(db), *args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    code, err = await _finish(proc, within=30)  # bounded: an accepted setting would serve on
    assert "Traceback" not in err, err
    assert code == 2, err
    assert named in err
    assert not db.exists()


def test_log_levels_are_read_in_any_case() -> None:
    from cv_server.cli import _parser

    assert _parser().parse_args(["serve", "--log-level", "debug"]).log_level == "DEBUG"


@pytest.fixture
async def silent_database() -> AsyncIterator[tuple[int, asyncio.Event]]:
    """A TCP port that accepts connections and never answers: a PostgreSQL server that hangs
    (or a firewall that swallows its replies). The event is set once a connection arrived."""
    arrived = asyncio.Event()
    held: list[asyncio.StreamWriter] = []

    async def accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        arrived.set()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], arrived
    finally:
        for writer in held:
            writer.transport.abort()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    "command",
    [["serve", "--port", "0"], ["token", "--workspace", "ws1"]],
    ids=["serve", "token"],
)
async def test_ctrl_c_while_waiting_for_the_database_exits_without_a_traceback(
    silent_database: tuple[int, asyncio.Event], command: list[str]
) -> None:
    """Ctrl-C on a server (or a token mint) stuck connecting to its database printed a
    KeyboardInterrupt traceback."""
    port, arrived = silent_database
    url = f"postgresql://postgres@127.0.0.1:{port}/test"
    proc = await asyncio.create_subprocess_exec(
        *_command(*command, "--database-url", url),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await asyncio.wait_for(arrived.wait(), 60)
        proc.send_signal(signal.SIGINT)
    finally:
        code, err = await _finish(proc, within=10)  # not the driver's 60 s connect timeout
    assert "Traceback" not in err, err
    assert code == 128 + signal.SIGINT


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["token", "--help"]])
def test_every_cv_server_command_has_working_help(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: cv-server")
