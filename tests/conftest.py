"""Shared fixtures. PostgreSQL tests read CV_TEST_DATABASE_URL; with CV_REQUIRE_POSTGRES=1 (CI)
a missing server is an error instead of a skip."""

from __future__ import annotations

import os

# Imported now, not first by Hypothesis's pytest plugin at the terminal summary: that late
# import compiles modules, and on CPython 3.11 `ast.parse` there fails with "AST constructor
# recursion depth mismatch" after a test has cancelled a task inside asyncpg (the interpreter's
# C recursion counter is left off by ~50; seen with tests/pg/test_oplog_failures.py run
# alone). The full suite imports it early anyway; this makes a partial run behave the same.
import hypothesis  # noqa: F401
import pytest

POSTGRES_URL = os.environ.get("CV_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
REQUIRE_POSTGRES = os.environ.get("CV_REQUIRE_POSTGRES") == "1"


@pytest.fixture
def postgres_url() -> str:
    """The PostgreSQL DSN for tests; skips (or fails in CI) when the server is unreachable."""
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(POSTGRES_URL)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 5432), 2):
            pass
    except OSError as exc:
        if REQUIRE_POSTGRES:
            pytest.fail(f"PostgreSQL at {POSTGRES_URL} is required here but unreachable: {exc}")
        pytest.skip(f"PostgreSQL unreachable at {POSTGRES_URL}")
    return POSTGRES_URL
