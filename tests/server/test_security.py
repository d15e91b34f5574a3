"""Tokens, tenancy and what the server logs, through a real server on loopback (SQLite, and
PostgreSQL where the store decides): what a token may touch, when it stops working, and that no
valid token or secret reaches the logs, the metrics or an error body."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import WSMsgType, web
from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.auth import mint_token, verify_token
from cv_server.cli import main as cv_server_main
from tests.acceptance.procs import create_sqlite_database
from tests.clocks import stop_token_clock
from tests.server.conftest import SECRET, ClientFactory, auth, token_for


@pytest.fixture
async def production_server(tmp_path: Path) -> AsyncIterator[tuple[str, int]]:
    """The app served the way `cv-server serve` serves it (`web.AppRunner`, no access log)."""
    app = create_app(ServerConfig(db_path=tmp_path / "cv.db", token_secret=SECRET))
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield "127.0.0.1", runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def _raw_request(host: str, port: int, data: bytes) -> bytes:
    """Send bytes no HTTP client library would send; return the whole answer."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


# -- tokens: minting -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--workspace", "ws1", "--ttl", "inf"], "ttl"),
        (["--workspace", "ws1", "--ttl", "nan"], "ttl"),
        (["--workspace", "ws1", "--ttl", "-60"], "ttl"),
        (["--workspace", "ws1,ws2"], "ws1,ws2"),
        (["--workspace", "ws 1"], "ws 1"),
        (["--workspace", "ws1", "--workspace", ""], "''"),
    ],
)
def test_cv_server_token_refuses_a_ttl_or_workspace_that_cannot_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], named: str
) -> None:
    """`--ttl inf` was a traceback, `--ttl -60` printed a token already expired and
    `--workspace ws1,ws2` one that grants nothing: each exit 0, found out only at use."""
    with pytest.raises(SystemExit) as exited:
        cv_server_main(["token", "--db", str(tmp_path / "cv.db"), *argv])
    assert exited.value.code not in (0, None)
    assert named in str(exited.value.code)
    assert capsys.readouterr().out == ""  # no token printed


def test_cv_server_token_mints_what_the_server_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = str(tmp_path / "cv.db")
    create_sqlite_database(Path(db))  # `token` reads the secret of an existing database only
    argv = ["token", "--db", db, "--workspace", "ws1", "--workspace", "*", "--ttl", "60"]
    assert cv_server_main(argv) == 0
    token = capsys.readouterr().out.strip()
    assert cv_server_main(["token", "--db", db, "--workspace", "ws-2_B"]) == 0
    assert capsys.readouterr().out.strip().startswith("cvt1.")
    claims = verify_token(_stored_secret(db), token, now=time.time())
    assert claims.workspaces == {"ws1", "*"}
    assert claims.expires_at is not None
    assert claims.expires_at - claims.issued_at == 60


def _stored_secret(db: str) -> bytes:
    import sqlite3

    with sqlite3.connect(db) as conn:
        row = conn.execute("SELECT value FROM server_meta WHERE key = 'token_secret'").fetchone()
    return bytes(row[0])


# -- tokens: what the server logs ------------------------------------------------------------------


async def test_a_malformed_request_carrying_a_valid_token_never_writes_the_token_to_the_log(
    production_server: tuple[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp logs a request it cannot parse at ERROR with a traceback whose message quotes the
    offending line: a `?token=` (the browser's way to the socket) or an Authorization header
    with one stray byte put a valid bearer token, in full, in the server's error log."""
    host, port = production_server
    token = token_for("ws1")
    signature = token.rsplit(".", 1)[1]
    caplog.set_level(logging.DEBUG)
    t = token.encode()
    for data in (
        b"GET /v1/workspaces/ws1/socket?token=" + t + b"&x=\x01 HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /v1/workspaces/ws1/socket?token=" + t + b" HTTP/1.1 x\r\nHost: x\r\n\r\n",
        b"GET /v1/workspaces/ws1/docs/tree HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer " + t + b"\x01\r\n\r\n",
        b"GET /v1/workspaces/ws1/docs/tree HTTP/1.1\r\nHost: x\r\n"
        b"Authorization : Bearer " + t + b"\r\n\r\n",
    ):
        answer = await _raw_request(host, port, data)
        assert answer.split(b" ", 2)[1] == b"400", answer
    records = [r for r in caplog.records if r.name.startswith("aiohttp")]
    assert len(records) == 4  # each bad request is still reported...
    assert signature not in caplog.text  # ...without the token
    # A client's malformed request is not a server error: one line, no traceback.
    assert all(r.levelno == logging.WARNING and r.exc_info is None for r in records)
    # The server still answers well-formed requests.
    answer = await _raw_request(
        host,
        port,
        b"GET /v1/workspaces/ws1/docs/tree HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Authorization: Bearer " + t + b"\r\n\r\n",
    )
    assert answer.split(b" ", 2)[1] == b"200", answer


async def test_the_token_secret_is_in_no_error_body_nor_the_metrics(
    client: TestClient[Any, Any],
) -> None:
    secret_texts = (SECRET.decode(), SECRET.hex())
    token = token_for("ws1")
    for method, path, headers in [
        ("GET", "/metrics", {}),
        ("GET", "/v1/workspaces/ws1/docs/tree", {"Authorization": f"Bearer {token[:-3]}"}),
        ("GET", "/v1/workspaces/ws1/docs/tree", {"Authorization": f"Bearer {token}x"}),
        ("GET", "/v1/workspaces/ws2/docs/tree", auth("ws1")),
        ("POST", "/v1/queue/claim", auth("ws1")),
    ]:
        resp = await client.request(method, path, headers=headers)
        text = await resp.text()
        assert not any(s in text for s in secret_texts), (path, text)
        assert "Traceback" not in text
        assert "/cv_server/" not in text


# -- the socket ------------------------------------------------------------------------------------


async def test_an_open_socket_is_closed_with_4001_when_its_token_expires(
    client: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTP refuses a token from the second it expires; a socket opened before then kept
    subscribing and applying under it for as long as it stayed open."""
    # Accepted at the handshake whenever it comes; the socket then has 5 s to live.
    token = mint_token(SECRET, ["ws1"], now=stop_token_clock(monkeypatch), ttl=5)
    ws = await client.ws_connect("/v1/workspaces/ws1/socket", params={"token": token})
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
    assert (await ws.receive_json(timeout=5))["type"] == "synced"
    msg = await ws.receive(timeout=15)  # exp is 5 s after the handshake
    assert msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.CLOSING), msg
    assert ws.close_code == 4001
    # A token without an expiry keeps its socket.
    lasting = await client.ws_connect("/v1/workspaces/ws1/socket", headers=auth("ws1"))
    await lasting.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
    assert (await lasting.receive_json(timeout=5))["type"] == "synced"
    await lasting.close()


async def test_an_expired_token_cannot_open_a_socket(client: TestClient[Any, Any]) -> None:
    expired = mint_token(SECRET, ["ws1"], now=time.time() - 10, ttl=5)
    for headers, params in (({}, {"token": expired}), ({"Authorization": f"Bearer {expired}"}, {})):
        ws = await client.ws_connect("/v1/workspaces/ws1/socket", headers=headers, params=params)
        await ws.receive(timeout=5)
        assert ws.close_code == 4001


async def test_frames_naming_another_workspace_stay_in_the_sockets_own(
    client: TestClient[Any, Any],
) -> None:
    """A frame has no say over the workspace: extra members naming another one are ignored."""
    await client.post(
        "/v1/workspaces/ws2/docs/tree/ops",
        json={"ops": [{"type": "node.insert", "node_id": "secret", "parent_id": "root"}]},
        headers=auth("ws2"),
    )
    ws = await client.ws_connect("/v1/workspaces/ws1/socket", headers=auth("ws1"))
    await ws.send_json(
        {"type": "subscribe", "sub_doc": "tree", "since": 0, "workspace_id": "ws2", "ws": "ws2"}
    )
    assert await ws.receive_json(timeout=5) == {"type": "synced", "sub_doc": "tree", "clock": 0}
    op = {"type": "node.insert", "node_id": "mine", "parent_id": "root"}
    await ws.send_json(
        {"type": "apply", "sub_doc": "tree", "req": 1, "ops": [op], "workspace_id": "ws2"}
    )
    frames = [await ws.receive_json(timeout=5), await ws.receive_json(timeout=5)]
    assert {f["type"] for f in frames} == {"op", "ack"}
    await ws.close()
    theirs = await client.get("/v1/workspaces/ws2/docs/tree", headers=auth("ws2"))
    assert set((await theirs.json())["state"]["nodes"]) == {"root", "secret"}
    mine = await client.get("/v1/workspaces/ws1/docs/tree", headers=auth("ws1"))
    assert set((await mine.json())["state"]["nodes"]) == {"root", "mine"}


async def test_the_socket_route_answers_a_plain_get_with_a_problem_and_a_code(
    client: TestClient[Any, Any],
) -> None:
    """Without the websocket upgrade, aiohttp's own text/plain 400 went out, with no `code`."""
    for headers in (auth("ws1"), {}):
        resp = await client.get("/v1/workspaces/ws1/socket", headers=headers)
        assert resp.status == 400
        assert resp.content_type == "application/problem+json"
        assert (await resp.json(content_type=None))["code"] == "bad_request"


# -- tenancy of the queue --------------------------------------------------------------------------


async def test_a_worker_token_for_one_workspace_never_claims_anothers_requests(
    aiohttp_client: ClientFactory, make_server_config: Callable[..., ServerConfig]
) -> None:
    """Pending, batched and lapsed (a dead worker's) requests of ws1 stay out of reach of a
    worker whose token grants ws2, on both stores."""
    server = await aiohttp_client(create_app(make_server_config(lease_seconds=0.2)))
    for job in ("A", "B"):
        resp = await server.post(
            "/v1/workspaces/ws1/requests",
            json={"stage": "evaluate", "job_id": job},
            headers=auth("ws1"),
        )
        assert resp.status == 202
    classes = {"worker_classes": ["evaluate"]}
    for body in (classes, {**classes, "limit": 10}):
        resp = await server.post("/v1/queue/claim", json=body, headers=auth("ws2"))
        assert resp.status == 204, await resp.text()
    # A ws1 worker takes one and dies: its lease lapses.
    held = await server.post("/v1/queue/claim", json=classes, headers=auth("ws1"))
    assert held.status == 200
    lapsed_id = (await held.json())["request"]["request_id"]
    deadline = time.monotonic() + 30  # for a 0.2 s lease: only a hang comes near it
    while True:  # until the lease has lapsed on the server's clock
        row = await server.get(f"/v1/workspaces/ws1/requests/{lapsed_id}", headers=auth("ws1"))
        if (await row.json())["lease_expires_at"] < time.time():
            break
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    for body in (classes, {**classes, "limit": 10}):
        resp = await server.post("/v1/queue/claim", json=body, headers=auth("ws2", "ws3"))
        assert resp.status == 204, await resp.text()
    pending = await server.get(
        "/v1/queue/pending",
        params={"worker_classes": "evaluate", "timeout": "0"},
        headers=auth("ws2"),
    )
    assert pending.status == 204
    both = await server.post("/v1/queue/claim", json={**classes, "limit": 10}, headers=auth("ws1"))
    assert len((await both.json())["requests"]) == 2


# -- follow-ups: headers that are not text, the secret's file -------------------------------------


async def test_an_idempotency_key_that_is_not_text_is_refused_not_a_server_error(
    make_server_config: Callable[..., ServerConfig],
) -> None:
    # aiohttp hands a non-UTF-8 header over with lone surrogates; the stores cannot encode them
    # (SQLite: "surrogates not allowed") and the enqueue answered 500, which clients retry.
    app = create_app(make_server_config())
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        body = b'{"stage":"evaluate","job_id":"J1","input":{}}'
        head = (
            f"POST /v1/workspaces/ws1/requests HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {token_for('ws1')}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n"
        ).encode()
        answer = await _raw_request(
            "127.0.0.1", port, head + b"Idempotency-Key: k\xff\xfe\r\n\r\n" + body
        )
    finally:
        await runner.cleanup()
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 422 " in status_line, answer[:300]
    assert b'"code": "invalid_field"' in rest or b'"code":"invalid_field"' in rest


async def test_the_sqlite_files_holding_the_token_secret_are_readable_by_their_owner_only(
    tmp_path: Path,
) -> None:
    # The database keeps the token secret: readable by any local user, it let them mint a `*`
    # token for every workspace.
    db = tmp_path / "data" / "cv.db"
    app = create_app(ServerConfig(db_path=db))
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5)
    await runner.setup()
    try:
        files = [db, Path(f"{db}-wal"), Path(f"{db}-shm")]
        modes = {path.name: path.stat().st_mode & 0o777 for path in files if path.exists()}
    finally:
        await runner.cleanup()
    assert "cv.db" in modes, modes
    assert "cv.db-wal" in modes, modes
    assert all(mode & 0o077 == 0 for mode in modes.values()), {k: oct(v) for k, v in modes.items()}


def test_cv_server_token_blames_the_arguments_not_the_secret_and_creates_no_database(
    tmp_path: Path,
) -> None:
    db = tmp_path / "cv.db"
    with pytest.raises(SystemExit) as exited:
        cv_server_main(["token", "--db", str(db), "--workspace", "ws1", "--ttl", "-1"])
    message = str(exited.value.code)
    assert "ttl" in message
    assert "secret" not in message
    assert not db.exists()


def test_the_config_repr_leaves_out_the_secret_and_the_database_url() -> None:
    config = ServerConfig(
        database_url="postgresql://app:hunter2@db.internal/cv", token_secret=b"s3cr3t-bytes"
    )
    assert "hunter2" not in repr(config)
    assert "s3cr3t" not in repr(config)


async def test_an_existing_database_readable_by_others_is_served_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file made by an older version, or copied in with the default mode, kept the mode its
    operator gave it (rightly: a backup group, say) and was served without a word."""
    db = tmp_path / "cv.db"
    db.touch(mode=0o644)
    db.chmod(0o644)  # whatever the umask did
    app = create_app(ServerConfig(db_path=db))
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5)
    with caplog.at_level(logging.WARNING, logger="cv_server.sqlite.engine"):
        await runner.setup()
        await runner.cleanup()
    warnings = [r.getMessage() for r in caplog.records if r.name == "cv_server.sqlite.engine"]
    assert any("readable by others" in message and "0o644" in message for message in warnings)
    assert db.stat().st_mode & 0o777 == 0o644  # not changed behind the operator's back

    caplog.clear()
    db.chmod(0o600)
    runner = web.AppRunner(create_app(ServerConfig(db_path=db)), access_log=None)
    with caplog.at_level(logging.WARNING, logger="cv_server.sqlite.engine"):
        await runner.setup()
        await runner.cleanup()
    assert not [r for r in caplog.records if r.name == "cv_server.sqlite.engine"]
