"""`cv-server rotate-secret` on SQLite: a leaked token secret is replaced without editing the
database by hand. The embedded server reads the secret once, at start, so the rotation is
refused while a server serves the file (it would go on accepting the leaked secret's tokens);
once it is stopped, the rotation takes, and the restarted server refuses every token minted
before. Like `token`, it never creates a database."""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
import subprocess
import sys
from pathlib import Path

import aiohttp

from tests.acceptance.procs import ServerProcess, create_sqlite_database, free_port

WS = "w"


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cv_server.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


async def _rotate(db: Path) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(_cli, "rotate-secret", "--db", str(db))


async def _mint(db: Path) -> str:
    answer = await asyncio.to_thread(_cli, "token", "--db", str(db), "--workspace", WS)
    assert answer.returncode == 0, answer.stderr
    return answer.stdout.strip()


def _secret(db: Path) -> bytes:
    with sqlite3.connect(db) as conn:
        row = conn.execute("SELECT value FROM server_meta WHERE key = 'token_secret'").fetchone()
    conn.close()
    return bytes(row[0])


def _one_line(err: str) -> str:
    assert err.endswith("\n"), err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def _digests(directory: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
        if path.is_file()
    }


async def _status(server: ServerProcess, token: str) -> int:
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{server.url}/v1/workspaces/{WS}/docs/main", headers=headers) as reply,
    ):
        return reply.status


async def test_rotation_is_refused_while_a_server_serves_the_file_and_changes_nothing(
    tmp_path: Path,
) -> None:
    """The server would keep the old secret in memory and accept the leaked one's tokens."""
    db = tmp_path / "cv.db"
    create_sqlite_database(db)
    before = _secret(db)
    token = await _mint(db)
    server = ServerProcess(db, free_port(), tmp_path / "server.log")
    await asyncio.to_thread(server.start)
    try:
        refused = await _rotate(db)
        assert refused.returncode == 1
        assert refused.stdout == ""
        message = _one_line(refused.stderr)
        assert message.startswith("cv-server rotate-secret: ")
        assert str(db) in message
        assert f"pid {server.proc.pid if server.proc else '?'}" in message
        assert "stop the server first" in message
        assert _secret(db) == before
        assert await _status(server, token) == 200  # still serving, with the same secret
    finally:
        assert await asyncio.to_thread(server.terminate) == 0


async def test_after_rotation_the_restarted_server_refuses_old_tokens_and_accepts_new_ones(
    tmp_path: Path,
) -> None:
    db = tmp_path / "cv.db"
    create_sqlite_database(db)
    old_secret = _secret(db)
    old_token = await _mint(db)
    server = ServerProcess(db, free_port(), tmp_path / "server.log")
    await asyncio.to_thread(server.start)
    try:
        assert await _status(server, old_token) == 200
    finally:
        assert await asyncio.to_thread(server.terminate) == 0

    rotated = await _rotate(db)
    assert rotated.returncode == 0, rotated.stderr
    assert rotated.stderr == ""
    # One line: what was done, and what it means for the tokens out there.
    assert rotated.stdout == (
        f"cv-server rotate-secret: replaced the token secret of {db}; every token minted"
        " before is now refused: mint new ones with `cv-server token`\n"
    )
    assert _secret(db) != old_secret
    new_token = await _mint(db)

    await asyncio.to_thread(server.start)
    try:
        assert await _status(server, old_token) == 401
        assert await _status(server, new_token) == 200
    finally:
        assert await asyncio.to_thread(server.terminate) == 0


async def test_each_rotation_replaces_the_secret_again_and_leaves_a_database_that_serves(
    tmp_path: Path,
) -> None:
    """Running it twice (a retried script, a second leak) is safe: each run succeeds with a
    fresh secret, a token minted between the two is refused after the second, and the file
    stays a database `init` keeps and `serve` serves."""
    db = tmp_path / "cv.db"
    create_sqlite_database(db)
    secrets_seen = [_secret(db)]
    tokens = [await _mint(db)]
    for _ in range(2):
        rotated = await _rotate(db)
        assert rotated.returncode == 0, rotated.stderr
        secrets_seen.append(_secret(db))
        tokens.append(await _mint(db))
    assert len(set(secrets_seen)) == 3
    kept = await asyncio.to_thread(_cli, "init", "--db", str(db))
    assert kept.returncode == 0, kept.stderr
    assert "its token secret is kept" in kept.stdout
    assert _secret(db) == secrets_seen[-1]
    server = ServerProcess(db, free_port(), tmp_path / "server.log")
    await asyncio.to_thread(server.start)
    try:
        assert [await _status(server, token) for token in tokens] == [401, 401, 200]
    finally:
        assert await asyncio.to_thread(server.terminate) == 0


def test_rotation_of_a_database_that_does_not_exist_is_refused_and_creates_nothing(
    tmp_path: Path,
) -> None:
    typo = tmp_path / "typo.db"
    answer = _cli("rotate-secret", "--db", str(typo))
    assert answer.returncode == 1
    assert answer.stdout == ""
    message = _one_line(answer.stderr)
    assert message.startswith("cv-server rotate-secret: no database at ")
    assert str(typo) in message
    assert list(tmp_path.iterdir()) == []  # no database, no -wal, no -shm, no lock

    default = _cli("rotate-secret", cwd=tmp_path)
    assert default.returncode == 1
    assert "data/cv.db" in _one_line(default.stderr)
    assert list(tmp_path.iterdir()) == []  # not even the data/ directory


def test_rotation_of_a_file_that_is_not_a_cv_server_database_is_refused_and_leaves_it(
    tmp_path: Path,
) -> None:
    db = tmp_path / "notes.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
    conn.close()
    before = _digests(tmp_path)
    answer = _cli("rotate-secret", "--db", str(db))
    assert answer.returncode == 1
    assert answer.stdout == ""
    assert "not a cv-server database" in _one_line(answer.stderr)
    assert _digests(tmp_path) == before
