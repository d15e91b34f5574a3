"""The `cv_server` fixture the package's pytest plugin gives an app's tests, run by pytest in an
app-shaped directory outside the repository (cv_workspace_client/testing/pytest_plugin.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.installed import BOUND

pytestmark = pytest.mark.acceptance

APP_TESTS = """
import pytest
from cv_mutations import NodeInsert
from cv_workspace_client import WorkspaceClient


def test_a_plain_test_gets_a_started_server(cv_server):
    assert cv_server.url.startswith("http://127.0.0.1:")
    assert cv_server.token("ws1")
    assert cv_server.database.parent.parent.name.startswith("test_a_plain_test")


@pytest.mark.asyncio
async def test_an_async_test_gets_one_of_its_own(cv_server):
    async with WorkspaceClient(cv_server.url, token=cv_server.token("ws1")) as client:
        commit = await client.apply_op("ws1", "tree", NodeInsert(node_id="n", parent_id="root"))
    assert commit.clock == 1  # a fresh database: the other test's server is not this one
"""


def _pytest(app: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=app,
        capture_output=True,
        text=True,
        timeout=BOUND,
    )


def _app(tmp_path: Path) -> Path:
    app = tmp_path / "app"
    (app / "tests").mkdir(parents=True)
    (app / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    (app / "tests" / "test_app.py").write_text(APP_TESTS)
    return app


def test_an_app_s_tests_get_the_fixture_without_a_conftest(tmp_path: Path) -> None:
    done = _pytest(_app(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


def test_an_app_that_leaves_the_plugin_out_has_no_such_fixture(tmp_path: Path) -> None:
    done = _pytest(_app(tmp_path), "-p", "no:cv_workspace")
    assert done.returncode == 1
    assert "fixture 'cv_server' not found" in done.stdout


def test_an_app_s_own_cv_server_fixture_wins(tmp_path: Path) -> None:
    app = _app(tmp_path)
    (app / "tests" / "conftest.py").write_text(
        "import pytest\n\n@pytest.fixture\ndef cv_server():\n    return 'mine'\n"
    )
    (app / "tests" / "test_app.py").write_text(
        "def test_mine(cv_server):\n    assert cv_server == 'mine'\n"
    )
    done = _pytest(app)
    assert done.returncode == 0, done.stdout + done.stderr


def test_loading_the_plugin_loads_no_server_package_and_no_async_plugin() -> None:
    code = (
        "import json, sys, cv_workspace_client.testing.pytest_plugin; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=BOUND
    )
    loaded = {name.split(".")[0] for name in json.loads(out.stdout)}
    unwanted = {"cv_server", "sqlite_utils", "asyncpg", "pytest_asyncio", "pytest_aiohttp"}
    assert loaded.isdisjoint(unwanted), sorted(loaded & unwanted)
