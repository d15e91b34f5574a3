"""`cv-server token` on SQLite reads the secret of an existing cv-server database and writes
nothing: only `serve` creates a database. A mistyped `--db` made a new file with a new secret,
and the token printed (exit 0) was one no server accepts."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from cv_server.auth import verify_token
from cv_server.cli import main
from tests.acceptance.procs import ServerProcess, create_sqlite_database, free_port


def _cli(command: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cv_server.cli", command, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def _token(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return _cli("token", *args, cwd=cwd)


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


def test_a_database_that_does_not_exist_is_refused_in_one_line_and_not_created(
    tmp_path: Path,
) -> None:
    typo = tmp_path / "typo.db"
    answer = _token("--db", str(typo), "--workspace", "w")
    assert answer.returncode == 1
    assert answer.stdout == ""  # nothing a script could mistake for a token
    assert str(typo) in _one_line(answer.stderr)
    assert answer.stderr.startswith("cv-server token: ")
    assert list(tmp_path.iterdir()) == []  # no database, no -wal, no -shm, no lock


def test_the_default_database_is_not_created_either(tmp_path: Path) -> None:
    answer = _token("--workspace", "w", cwd=tmp_path)
    assert answer.returncode == 1
    assert answer.stdout == ""
    assert "data/cv.db" in _one_line(answer.stderr)
    assert list(tmp_path.iterdir()) == []  # not even the data/ directory


def _unrelated_sqlite_file(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
        conn.execute("INSERT INTO notes VALUES ('mine')")
    conn.close()


@pytest.mark.parametrize(
    "make",
    [lambda path: path.write_bytes(b""), _unrelated_sqlite_file],
    ids=["empty-file", "unrelated-sqlite-file"],
)
def test_a_file_that_is_not_a_cv_server_database_is_refused_and_left_untouched(
    tmp_path: Path, make: object
) -> None:
    """The token command opened the file as the server does: it wrote every table of the
    server's schema and a new secret into it, and printed a token for that secret."""
    db = tmp_path / "other.db"
    assert callable(make)
    make(db)
    before = _digests(tmp_path)
    answer = _token("--db", str(db), "--workspace", "w")
    assert answer.returncode == 1
    assert answer.stdout == ""
    message = _one_line(answer.stderr)
    assert str(db) in message
    assert "not a cv-server database" in message
    assert _digests(tmp_path) == before


def test_a_directory_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["token", "--db", str(tmp_path), "--workspace", "w"])
    assert str(exited.value.code) == f"cv-server token: {tmp_path} is not a database file"


def test_the_token_of_a_database_serve_created_is_read_without_writing_to_it(
    tmp_path: Path,
) -> None:
    db = tmp_path / "cv.db"
    create_sqlite_database(db)
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    answer = _token("--db", str(db), "--workspace", "w", "--ttl", "60")
    assert answer.returncode == 0, answer.stderr
    assert answer.stderr == ""
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    with sqlite3.connect(db) as conn:
        secret = conn.execute("SELECT value FROM server_meta WHERE key = 'token_secret'").fetchone()
    conn.close()
    claims = verify_token(bytes(secret[0]), answer.stdout.strip(), now=time.time())
    assert claims.workspaces == {"w"}


async def test_a_token_minted_while_the_server_runs_is_accepted_by_it(tmp_path: Path) -> None:
    db = tmp_path / "cv.db"
    server = ServerProcess(db, free_port(), tmp_path / "server.log")
    await asyncio.to_thread(server.start)
    try:
        answer = await asyncio.to_thread(_token, "--db", str(db), "--workspace", "w")
        assert answer.returncode == 0, answer.stderr
        headers = {"Authorization": f"Bearer {answer.stdout.strip()}"}
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{server.url}/v1/workspaces/w/docs/main", headers=headers) as reply,
        ):
            assert reply.status == 200, await reply.text()
    finally:
        assert await asyncio.to_thread(server.terminate) == 0


def _init(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return _cli("init", *args, cwd=cwd)


def _secret(db: Path) -> bytes:
    with sqlite3.connect(db) as conn:
        row = conn.execute("SELECT value FROM server_meta WHERE key = 'token_secret'").fetchone()
    conn.close()
    return bytes(row[0])


async def test_init_then_token_then_serve_is_the_quick_start_and_the_token_is_accepted(
    tmp_path: Path,
) -> None:
    """`scripts/serve`'s order on a fresh machine: `init` sets up the database (`token` no
    longer creates one), `token` reads its secret, and `serve` accepts the token."""
    db = tmp_path / "data" / "cv.db"
    created = await asyncio.to_thread(_init, "--db", str(db))
    assert created.returncode == 0, created.stderr
    # One line says what happened (it printed nothing, so a first run and a typo'd path
    # pointing at a new file looked the same as a start on the real database).
    assert created.stdout == f"cv-server init: set up a new database at {db}\n"
    secret = _secret(db)
    again = await asyncio.to_thread(_init, "--db", str(db))  # every start of the script runs it
    assert again.returncode == 0, again.stderr
    assert again.stdout == f"cv-server init: {db} is already set up; its token secret is kept\n"
    assert _secret(db) == secret  # idempotent: tokens minted before stay valid
    answer = await asyncio.to_thread(_token, "--db", str(db), "--workspace", "w")
    assert answer.returncode == 0, answer.stderr
    server = ServerProcess(db, free_port(), tmp_path / "server.log")
    await asyncio.to_thread(server.start)
    try:
        headers = {"Authorization": f"Bearer {answer.stdout.strip()}"}
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{server.url}/v1/workspaces/w/docs/main", headers=headers) as reply,
        ):
            assert reply.status == 200, await reply.text()
    finally:
        assert await asyncio.to_thread(server.terminate) == 0


def test_init_refuses_a_file_that_is_not_a_cv_server_database_in_one_line(
    tmp_path: Path,
) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("not a database\n")
    # Readable by others: the "holds the token secret" warning came first, about a file that
    # holds none. It is for a database that opened, so the refusal is the one line.
    path.chmod(0o644)
    answer = _init("--db", str(path))
    assert answer.returncode == 1
    assert _one_line(answer.stderr).startswith("cv-server init: ")
    assert path.read_text() == "not a database\n"


def _revoked_ids(db: Path) -> set[str]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT token_id FROM token_revocations").fetchall()
    conn.close()
    return {row[0] for row in rows}


@pytest.mark.parametrize(
    "placement",
    ["before-revoke", "after-revoke", "environment"],
)
def test_revoke_takes_backend_flags_on_either_side_of_the_subcommand(
    tmp_path: Path, placement: str
) -> None:
    """`token --db X revoke ID` revoked in the default file (the subcommand's own default
    overwrote the parent's flag) and reported success: the token stayed valid."""
    db = tmp_path / "mine.db"
    create_sqlite_database(db)
    decoy = tmp_path / "data" / "cv.db"  # the default file, relative to the working directory
    decoy.parent.mkdir()
    create_sqlite_database(decoy)
    minted = _token("--db", str(db), "--workspace", "w", "--ttl", "600")
    assert minted.returncode == 0, minted.stderr
    token = minted.stdout.strip()
    env = None
    if placement == "before-revoke":
        args = ["token", "--db", str(db), "revoke", token]
    elif placement == "after-revoke":
        args = ["token", "revoke", "--db", str(db), token]
    else:
        args = ["token", "revoke", token]
        env = {**os.environ, "CV_DB": str(db)}
    answer = subprocess.run(
        [sys.executable, "-m", "cv_server.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
    )
    assert answer.returncode == 0, answer.stderr
    assert str(db) in answer.stdout
    assert len(_revoked_ids(db)) == 1
    assert _revoked_ids(decoy) == set()
