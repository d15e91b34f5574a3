"""Acceptance: the real `cv-server` on its embedded SQLite file at the edges of its life cycle —
a second server on the same file, files it must refuse, the drain deadline with a request
stream open, SIGINT, and the health, readiness and metrics routes."""

from __future__ import annotations

import asyncio
import math
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cv_server.cli import parse_overrides
from tests.acceptance.procs import free_port, mint_cli_token

pytestmark = pytest.mark.acceptance


class _Server:
    """`cv-server serve` with extra arguments; the URL comes from its first stdout line."""

    def __init__(self, db: Path, log: Path, *extra: str) -> None:
        self._log: IO[str] = log.open("a")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cv_server.cli",
                "serve",
                "--db",
                str(db),
                "--port",
                "0",
                "--log-level",
                "WARNING",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # returns at the listening line or at exit
        match = re.search(r"listening on (http://\S+)", line)
        if match is None:
            self.stop()
            raise RuntimeError(f"server did not start: {line!r}; see {log}")
        self.url = match.group(1)

    def signal_and_wait(self, sig: signal.Signals, timeout: float = 60) -> tuple[int, float]:
        started = time.monotonic()
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=timeout)
        return code, time.monotonic() - started

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


def _refused_start(*args: str) -> subprocess.CompletedProcess[str]:
    """Run a `cv-server` command that must fail at start; it must exit, not serve."""
    return subprocess.run(
        [sys.executable, "-m", "cv_server.cli", *args],
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )


#: A start-up step's log line, text format: `2026-12-02T04:02:20.262Z INFO cv_server.cli: ...`
_STEP_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\S+ (DEBUG|INFO) ")


def _assert_one_clear_line(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 1, result
    assert "listening" not in result.stdout
    assert "Traceback" not in result.stderr
    # The start-up steps before the failure are INFO log lines (docs/observability.md); the
    # refusal itself is one line, the last, and nothing else is said.
    said = result.stderr.strip().splitlines()
    lines = [line for line in said if not _STEP_LOG_LINE.match(line)]
    assert len(lines) == 1, result.stderr
    assert said[-1] == lines[0], result.stderr
    assert lines[0].startswith(("cv-server: ", "cv-server token: ")), result.stderr
    for word in words:
        assert word in lines[0]


async def _post_ops(url: str, token: str, ops: list[dict[str, object]]) -> tuple[int, object]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{url}/v1/workspaces/acc/docs/tree/ops",
            json={"ops": ops},
            headers={"Authorization": f"Bearer {token}"},
        ) as resp,
    ):
        return resp.status, await resp.json(content_type=None)


def _insert(node_id: str, op_id: str) -> dict[str, object]:
    return {"type": "node.insert", "node_id": node_id, "parent_id": "root", "op_id": op_id}


def test_a_second_server_on_the_same_sqlite_file_refuses_to_start(tmp_path: Path) -> None:
    # Before the fix the second server started, and once it wrote to a sub-doc the first one
    # answered 500 on every later write there (its cached head was behind the disk).
    db = tmp_path / "cv.db"
    token = mint_cli_token(db, "acc")
    first = _Server(db, tmp_path / "first.log")
    try:
        assert (
            asyncio.run(_post_ops(first.url, token, [_insert("a", "op-a-000000000001")]))[0] == 200
        )
        second = _refused_start("serve", "--db", str(db), "--port", str(free_port()))
        _assert_one_clear_line(second, "already served", str(first.proc.pid))
        # The first server is untouched, and tokens can still be minted while it runs.
        assert mint_cli_token(db, "acc")
        status, body = asyncio.run(_post_ops(first.url, token, [_insert("b", "op-b-000000000001")]))
        assert status == 200
        assert body == {"results": [{"op_id": "op-b-000000000001", "clock": 2, "duplicate": False}]}
        first.proc.send_signal(signal.SIGKILL)  # the kernel drops the lock with the process
        first.proc.wait(timeout=30)
    finally:
        first.stop()
    third = _Server(db, tmp_path / "third.log")
    try:  # after the crash a new server may take the file over, and has every acked op
        status, body = asyncio.run(_post_ops(third.url, token, [_insert("b", "op-b-000000000001")]))
        assert body == {"results": [{"op_id": "op-b-000000000001", "clock": 2, "duplicate": True}]}
    finally:
        third.stop()


def test_a_corrupted_database_file_is_refused_in_one_line_by_serve_and_token(
    tmp_path: Path,
) -> None:
    db = tmp_path / "cv.db"
    db.write_bytes(b"not a database, not at all " * 400)
    db.chmod(0o600)  # the owner's alone, as the server makes it: no warning about the mode
    serve = _refused_start("serve", "--db", str(db), "--port", str(free_port()))
    _assert_one_clear_line(serve, "file is not a database")
    token = _refused_start("token", "--db", str(db), "--workspace", "acc")
    _assert_one_clear_line(token, "file is not a database")
    assert token.stdout == ""  # nothing a script could mistake for a token


def test_a_postgresql_database_role_or_schema_that_is_missing_is_one_line(
    postgres_url: str,
) -> None:
    """Each was a traceback (asyncpg's errors and the backend's own were not start-up errors)."""
    parsed = urlsplit(postgres_url)
    no_db = urlunsplit(parsed._replace(path="/cv_no_such_database"))
    serve = _refused_start("serve", "--database-url", no_db, "--port", str(free_port()))
    _assert_one_clear_line(serve, "cv_no_such_database", "does not exist")
    no_role = urlunsplit(parsed._replace(netloc=f"cv_no_such_role@{parsed.hostname}:{parsed.port}"))
    token = _refused_start("token", "--database-url", no_role, "--workspace", "acc")
    _assert_one_clear_line(token, "cv_no_such_role")
    assert token.stdout == ""
    no_schema = ("--database-url", postgres_url, "--schema", "cv_no_such_schema")
    token = _refused_start("token", *no_schema, "--workspace", "acc")
    _assert_one_clear_line(token, "cv_no_such_schema", "create it first")


def test_a_database_written_by_a_newer_schema_is_refused_at_start_up(tmp_path: Path) -> None:
    db = tmp_path / "cv.db"
    mint_cli_token(db, "acc")  # creates the file with this version's schema
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] >= 1  # stamped at creation
        conn.execute("PRAGMA user_version = 999")
    serve = _refused_start("serve", "--db", str(db), "--port", str(free_port()))
    _assert_one_clear_line(serve, "schema version 999", "upgrade")


@pytest.mark.parametrize("item", ["drain_seconds=nan", "lease_seconds=-1", "sweep_seconds=inf"])
def test_a_setting_that_is_not_a_finite_non_negative_number_is_refused(item: str) -> None:
    with pytest.raises(SystemExit, match="finite number"):
        parse_overrides([item])
    assert parse_overrides(["drain_seconds=2.5", "max_dequeues=0"]) == {
        "drain_seconds": 2.5,
        "max_dequeues": 0,
    }


def test_a_zero_snapshot_interval_fails_start_up_in_one_line(tmp_path: Path) -> None:
    serve = _refused_start(
        "serve", "--db", str(tmp_path / "cv.db"), "--port", "0", "--set", "snapshot_every=0"
    )
    _assert_one_clear_line(serve, "snapshot_every")


def test_sigterm_with_a_request_stream_open_exits_within_the_drain_deadline(
    tmp_path: Path,
) -> None:
    # aiohttp waits `shutdown_timeout` twice for a handler that reads no body: the SSE stream of
    # a request nobody works on held SIGTERM for twice the drain deadline.
    drain = 6.0
    db = tmp_path / "cv.db"
    token = mint_cli_token(db, "acc")
    server = _Server(db, tmp_path / "server.log", "--set", f"drain_seconds={drain}")
    headers = {"Authorization": f"Bearer {token}"}

    async def scenario() -> tuple[int, float, bytes]:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                f"{server.url}/v1/workspaces/acc/requests",
                json={"stage": "evaluate", "job_id": "J1", "input": {}},
                headers=headers,
            ) as resp:
                assert resp.status == 202
                stream_url = (await resp.json())["stream_url"]
            async with session.get(f"{server.url}{stream_url}", headers=headers) as stream:
                assert await stream.content.readline() == b"event: queued\n"
                await stream.content.readline()  # the queued event's data
                await stream.content.readline()
                stopping = asyncio.ensure_future(
                    asyncio.to_thread(server.signal_and_wait, signal.SIGTERM)
                )
                # The stream is told that its wait ended (the work goes on), not cut.
                rest = await asyncio.wait_for(stream.content.read(), drain + 3)
                code, took = await stopping
                return code, took, rest

    try:
        code, took, rest = asyncio.run(scenario())
    finally:
        server.stop()
    assert code == 0
    assert took < drain, f"SIGTERM took {took:.1f} s with a {drain} s drain deadline"
    assert rest.startswith(b"event: error\n"), rest
    assert b'"wait_timeout"' in rest, rest
    assert b'"status":"pending"' in rest.replace(b" ", b""), rest


def test_sigint_drains_like_sigterm_closing_sockets_with_1001(tmp_path: Path) -> None:
    db = tmp_path / "cv.db"
    token = mint_cli_token(db, "acc")
    server = _Server(db, tmp_path / "server.log")

    async def scenario() -> tuple[int | None, int]:
        headers = {"Authorization": f"Bearer {token}"}
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(f"{server.url}/v1/workspaces/acc/socket", headers=headers) as ws,
        ):
            await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
            assert (await ws.receive_json(timeout=10))["type"] == "synced"

            async def read_until_closed() -> int | None:
                async for _ in ws:
                    pass
                return ws.close_code

            reader = asyncio.create_task(read_until_closed())
            code, _ = await asyncio.to_thread(server.signal_and_wait, signal.SIGINT)
            return await asyncio.wait_for(reader, 10), code

    try:
        close_code, exit_code = asyncio.run(scenario())
    finally:
        server.stop()
    assert (close_code, exit_code) == (1001, 0)


def _parse_prometheus_text(text: str) -> dict[str, float]:
    """The text exposition format as Prometheus' own parser (prometheus-client's) reads it, with
    what a strict scraper also wants: every family has HELP, counters never go below zero, values
    are numbers. Samples of one name (one per label set) are summed."""
    assert text.endswith("\n")
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        assert family.documentation, f"{family.name} has no HELP"
        for sample in family.samples:
            assert math.isfinite(sample.value) or sample.name.endswith("_bucket"), sample
            if family.type == "counter" and sample.name.endswith("_total"):
                assert sample.value >= 0, sample
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


def test_health_readiness_and_metrics_of_a_running_server(tmp_path: Path) -> None:
    db = tmp_path / "cv.db"
    token = mint_cli_token(db, "acc")
    server = _Server(db, tmp_path / "server.log")

    async def scenario() -> tuple[dict[str, float], dict[str, float]]:
        async with aiohttp.ClientSession() as session:
            for route in ("/healthz", "/readyz"):  # no token needed
                async with session.get(f"{server.url}{route}") as resp:
                    assert resp.status == 200, route
            async with session.get(f"{server.url}/metrics") as resp:
                assert resp.status == 200
                assert resp.content_type == "text/plain"
                before = _parse_prometheus_text(await resp.text())
            ops = [
                _insert("n", "op-n-000000000001"),
                _insert("n", "op-n-000000000002"),  # node_exists: rejected
            ]
            assert (await _post_ops(server.url, token, ops))[0] == 200
            assert (await _post_ops(server.url, token, ops[:1]))[0] == 200  # a duplicate
            async with session.get(f"{server.url}/metrics") as resp:
                after = _parse_prometheus_text(await resp.text())
        return before, after

    try:
        before, after = asyncio.run(scenario())
    finally:
        server.stop()
    assert before["cv_ops_committed_total"] == 0
    assert after["cv_ops_committed_total"] == 1
    assert after["cv_ops_rejected_total"] == 1
    assert after["cv_ops_duplicate_total"] == 1
    assert after["cv_ws_connections"] == 0
