"""`LocalServer` runs the real `cv-server` command: it starts, answers `/readyz`, mints tokens
the server accepts, stops with SIGTERM (SIGKILL after its bound), and reports the process's
stderr when it cannot start (cv_workspace_client/testing/local_server.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from cv_mutations import NodeInsert
from cv_workspace_client import ForbiddenError, WorkspaceClient, WorkspaceError
from cv_workspace_client.testing import LocalServer, LocalServerError
from tests.pg.helpers import fresh_schema

pytestmark = pytest.mark.acceptance


def _ready(url: str) -> int:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
        f"{url}/readyz", timeout=10
    ) as answer:
        return int(answer.status)


def test_it_serves_on_a_free_loopback_port_and_stops_on_sigterm(tmp_path: Path) -> None:
    with LocalServer(tmp_path) as server:
        assert server.url.startswith("http://127.0.0.1:")
        assert _ready(server.url) == 200
        assert server.database == tmp_path / "cv.db"
        assert server.database.exists()
        assert "stores open, serving" in server.log()
    assert server.returncode == 0  # drained and exited on SIGTERM
    assert not server.killed
    assert "stopped" in (tmp_path / "server.log").read_text()


def test_two_servers_at_once_each_get_a_port_of_their_own(tmp_path: Path) -> None:
    with LocalServer(tmp_path / "a") as first, LocalServer(tmp_path / "b") as second:
        assert first.url != second.url
        assert _ready(first.url) == _ready(second.url) == 200


async def test_its_tokens_grant_their_workspaces_and_no_other() -> None:
    async with LocalServer() as server:
        token = await asyncio.to_thread(server.token, "ws1")
        assert server.token("ws1") == token  # minted once per set of workspaces
        async with WorkspaceClient(server.url, token=token) as client:
            commit = await client.apply_op("ws1", "tree", NodeInsert(node_id="n", parent_id="root"))
            assert commit.clock == 1
            with pytest.raises(ForbiddenError):
                await client.get_state("ws2", "tree")
        every = await asyncio.to_thread(server.token, "*")
        async with WorkspaceClient(server.url, token=every) as client:
            clock, _ = await client.get_state("ws2", "tree")
            assert clock == 0


def test_a_token_with_a_ttl_is_minted_anew_each_time() -> None:
    with LocalServer() as server:
        assert server.token("ws1", ttl=60) != server.token("ws1")
        with pytest.raises(ValueError, match="at least one workspace"):
            server.token()


def test_without_a_directory_its_temporary_one_is_removed_at_stop() -> None:
    with LocalServer() as server:
        database = server.database
        assert database is not None
        assert database.exists()
    assert not database.parent.exists()


def test_it_is_started_once_and_has_no_url_before() -> None:
    server = LocalServer()
    with pytest.raises(RuntimeError, match="not started"):
        _ = server.url
    with pytest.raises(RuntimeError, match="not started"):
        server.token("ws1")
    with server, pytest.raises(RuntimeError, match="already started"):
        server.start()
    server.stop()  # idempotent


def test_a_setting_it_refuses_is_reported_with_its_stderr(tmp_path: Path) -> None:
    with pytest.raises(LocalServerError) as caught:
        LocalServer(tmp_path, settings={"no_such_setting": 1}).start()
    assert "exited with status 1 before listening" in str(caught.value)
    assert "--set 'no_such_setting=1': settable:" in caught.value.stderr
    assert caught.value.stderr.strip() in str(caught.value)  # shown without asking
    assert isinstance(caught.value, WorkspaceError)
    assert caught.value.code == "local_server_failed"


def test_a_database_it_cannot_open_is_reported_with_its_stderr(tmp_path: Path) -> None:
    (tmp_path / "cv.db").write_bytes(b"not a database, " * 512)
    server = LocalServer(tmp_path)
    with pytest.raises(LocalServerError, match="cannot start: file is not a database"):
        server.start()
    assert server.returncode == 1


def test_a_command_that_is_not_there_is_reported() -> None:
    with pytest.raises(LocalServerError, match="cannot run /nonexistent/cv-server"):
        LocalServer(command=["/nonexistent/cv-server"]).start()


@pytest.fixture
def silent_database() -> Iterator[socket.socket]:
    """A listener in PostgreSQL's place: it takes connections (its backlog does) and never says a
    word, so a server connecting to it hangs in its start."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield listener


def test_a_start_that_outlives_its_bound_is_killed_and_reported(
    silent_database: socket.socket,
) -> None:
    port = silent_database.getsockname()[1]
    url = f"postgresql://postgres@127.0.0.1:{port}/test"
    server = LocalServer(database_url=url, start_timeout=5)
    with pytest.raises(LocalServerError, match="no listening line within 5 s") as caught:
        server.start()
    assert server.returncode == -signal.SIGKILL
    assert server.killed
    silent_database.settimeout(0)
    try:
        silent_database.accept()[0].close()
    except BlockingIOError:
        # The server was still importing at the bound: killed before it wrote a line.
        return
    # It reached the database, so it had logged the step it hung in.
    assert "opening the postgresql stores" in caught.value.stderr


def test_a_server_that_ignores_sigterm_is_killed_after_the_stop_bound(tmp_path: Path) -> None:
    server = LocalServer(tmp_path, stop_timeout=0.5)
    server.start()
    assert server.pid is not None
    # A stopped process handles no signal but SIGKILL: SIGTERM stays pending, as in a server
    # that hangs in its drain.
    os.kill(server.pid, signal.SIGSTOP)
    began = time.monotonic()
    server.stop()
    assert server.killed
    assert server.returncode == -signal.SIGKILL
    # The stop bound (0.5 s), not the server's 25 s drain, decided when it ended.
    assert time.monotonic() - began < 10


async def test_a_start_cancelled_midway_leaves_no_process_behind(tmp_path: Path) -> None:
    server = LocalServer(tmp_path)
    starting = asyncio.create_task(server.__aenter__())
    await asyncio.sleep(0)  # one turn of the loop: the start is under way in its thread
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert server.pid is None or server.returncode is not None


@pytest.mark.postgres
async def test_it_serves_from_a_postgresql_schema(postgres_url: str) -> None:
    async with fresh_schema(postgres_url) as schema:
        async with LocalServer(database_url=postgres_url, schema=schema) as server:
            assert server.database is None
            token = await asyncio.to_thread(server.token, "ws1")
            async with WorkspaceClient(server.url, token=token) as client:
                await client.apply_op("ws1", "tree", NodeInsert(node_id="n", parent_id="root"))
                clock, _ = await client.get_state("ws1", "tree")
                assert clock == 1
        assert server.returncode == 0
