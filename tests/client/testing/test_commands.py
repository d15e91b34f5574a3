"""The `cv-server` command lines `LocalServer` runs, and its reading of the listening line:
pure (cv_workspace_client/testing/_commands.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cv_workspace_client.testing._commands import (
    Backend,
    child_environment,
    listening_url,
    serve_args,
    token_args,
)

pytestmark = pytest.mark.unit


def test_serve_binds_a_free_loopback_port_on_the_sqlite_file() -> None:
    args = serve_args(Backend(db=Path("/d/cv.db")), settings={"lease_seconds": 5})
    assert args == [
        "serve", "--db", "/d/cv.db", "--host", "127.0.0.1", "--port", "0",
        "--log-level", "INFO", "--set", "lease_seconds=5",
    ]  # fmt: skip


def test_a_database_url_wins_and_names_its_schema() -> None:
    backend = Backend(db=Path("x.db"), database_url="postgresql://h/db", schema="s1")
    assert backend.args() == ["--database-url", "postgresql://h/db", "--schema", "s1"]
    assert Backend(database_url="postgresql://h/db").args() == [
        "--database-url",
        "postgresql://h/db",
    ]


def test_a_backend_needs_a_file_or_a_url_and_a_schema_needs_the_url() -> None:
    with pytest.raises(ValueError, match="db"):
        Backend()
    with pytest.raises(ValueError, match="schema"):
        Backend(db=Path("x.db"), schema="s1")


def test_a_token_grants_each_workspace_and_expires_only_when_asked() -> None:
    backend = Backend(db=Path("cv.db"))
    assert token_args(backend, ["ws1", "ws2"]) == [
        "token", "--db", "cv.db", "--workspace", "ws1", "--workspace", "ws2",
    ]  # fmt: skip
    assert token_args(backend, ["*"], ttl=60)[-2:] == ["--ttl", "60.0"]
    with pytest.raises(ValueError, match="at least one workspace"):
        token_args(backend, [])


@pytest.mark.parametrize(
    ("line", "url"),
    [
        ("cv-server listening on http://127.0.0.1:41234\n", "http://127.0.0.1:41234"),
        ("cv-server listening on http://127.0.0.1:41234/", "http://127.0.0.1:41234"),
        ('{"message": "cv-server listening on http://127.0.0.1:1"}', None),
        ("starting: opening the sqlite stores", None),
        ("", None),
    ],
)
def test_only_the_listening_line_yields_a_url(line: str, url: str | None) -> None:
    assert listening_url(line) == url


def test_the_server_gets_no_cv_variable_of_the_test_run() -> None:
    parent = {"PATH": "/bin", "CV_PORT": "9", "CV_SCHEMA": "other", "HOME": "/h"}
    assert child_environment(parent) == {"PATH": "/bin", "HOME": "/h"}
