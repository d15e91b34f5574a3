"""Shared fixtures. PostgreSQL tests read CV_TEST_DATABASE_URL; with CV_REQUIRE_POSTGRES=1 (CI)
a missing server is an error instead of a skip."""

from __future__ import annotations

import os
import signal
from pathlib import Path

# Imported now, not first by Hypothesis's pytest plugin at the terminal summary: that late
# import compiles modules, and on CPython 3.11 `ast.parse` there fails with "AST constructor
# recursion depth mismatch" after a test has cancelled a task inside asyncpg (the interpreter's
# C recursion counter is left off by ~50; seen with tests/pg/test_oplog_failures.py run
# alone). The full suite imports it early anyway; this makes a partial run behave the same.
import hypothesis  # noqa: F401
import pytest

# A suite started in the background of a shell without job control (`nohup ... &`) inherits
# SIGINT ignored, and an ignored signal stays ignored in every process it starts: their Ctrl-C
# would do nothing. The processes the Ctrl-C tests start get the default, as from a terminal
# (tests/server/test_cli_operator.py, tests/cli/test_operator.py).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

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


@pytest.fixture(scope="session")
def sdk_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of the checkout, built once per session (tests/installed.py installs it)."""
    from tests.installed import build_wheel

    return build_wheel(tmp_path_factory.mktemp("wheel"))


# -- cost markers ------------------------------------------------------------------------------
#
# Every test carries exactly one of `unit`, `property`, `contract`, `integration`, `acceptance`,
# so that `./scripts/test -m unit` runs the fast pure tests alone. A test's own mark wins (a file
# that is the exception to its directory says so with `pytestmark`); otherwise:
#   - tests/acceptance/ is `acceptance` (real processes, killed), tests/contract/ is `contract`
#     (one suite per storage interface, on both backends);
#   - tests/mutations/ and tests/queue/ are `unit` (the pure reducers and queue rules), unless the
#     test asks for a fixture that reaches a file, a socket or a database;
#   - everything else is `integration` (a real server on loopback, a real SQLite file).
# A pure test that Hypothesis drives (`@given`, a state machine's TestCase, or marked `property`
# itself because it calls `run_state_machine_as_test`) is `property`, not `unit`: pure, but
# hundreds of generated examples each (`./scripts/test -m "unit or property"`: every pure test).

COST_MARKS = ("unit", "property", "contract", "integration", "acceptance")
_UNIT_DIRS = ("mutations", "queue")
_IO_FIXTURES = frozenset(
    {
        "tmp_path",
        "tmp_path_factory",
        "tmpdir",
        "postgres_url",
        "aiohttp_server",
        "aiohttp_client",
        "aiohttp_raw_server",
        "aiohttp_unused_port",
        "unused_tcp_port",
    }
)


def _cost_of(item: pytest.Item) -> str:
    parts = item.path.relative_to(item.config.rootpath).parts
    area = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
    if area in ("acceptance", "contract"):
        return area
    uses_io = not _IO_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))
    if area in _UNIT_DIRS and not uses_io:
        return "unit"
    return "integration"


def _is_property(item: pytest.Item) -> bool:
    if item.get_closest_marker("property"):
        return True
    if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
        return True
    cls = getattr(item, "cls", None)
    return cls is not None and cls.__module__ == "hypothesis.stateful"


def _declared_cost(item: pytest.Item) -> str | None:
    return next((name for name in COST_MARKS if item.get_closest_marker(name)), None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    costs = []
    for item in items:
        cost = _declared_cost(item) or _cost_of(item)
        if cost == "unit" and _is_property(item):
            cost = "property"
        costs.append(cost)
    for item, cost in zip(items, costs, strict=True):
        # One cost per test: a module's `pytestmark = unit` yields to `property` for the
        # Hypothesis-driven tests in it (tests/test_cost_marks.py).
        for node in item.listchain():
            node.own_markers[:] = [m for m in node.own_markers if m.name not in COST_MARKS]
        item.add_marker(getattr(pytest.mark, cost))
