"""`pip install cv-workspace` without extras, into a fresh virtualenv, offline, from the checkout:
the SDK works against a real server, and `cv-server` names the extra it needs instead of dying
on an import."""

from __future__ import annotations

import asyncio
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from cv_server import ServerConfig, create_app
from cv_server.auth import mint_token
from tests.installed import ROOT, install_wheel, run_in

SECRET = b"packaging-test-secret-0123456789abcdef"
PACKAGES = ("cv_mutations", "cv_workspace_client", "cv_server")


@pytest.fixture(scope="module")
def fresh_venv(sdk_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed without extras."""
    return install_wheel(sdk_wheel, tmp_path_factory.mktemp("packaging"))


def _run(venv: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    # From a directory without the checkout in it: the installed wheel is what runs.
    return run_in(venv, *argv)


def test_the_wheel_ships_the_checkout_s_modules_and_no_stale_one(sdk_wheel: Path) -> None:
    # A module deleted or moved since the last build must not ship from a leftover `build/`.
    with zipfile.ZipFile(sdk_wheel) as wheel:
        shipped = {name for name in wheel.namelist() if name.endswith(".py")}
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *PACKAGES],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert shipped == {name for name in tracked if name.endswith(".py") and (ROOT / name).exists()}


def test_the_venv_has_the_sdk_and_not_the_server_extra(fresh_venv: Path) -> None:
    """The check the rest stands on: the server extra's packages are really absent there."""
    for module in ("sqlite_utils", "asyncpg", "uvloop"):
        probe = _run(fresh_venv, "python", "-c", f"import {module}")
        assert probe.returncode != 0, module
    assert _run(fresh_venv, "python", "-c", "import cv_workspace_client").returncode == 0


@pytest.mark.parametrize("argv", [["--help"], ["serve"], ["token", "--workspace", "w"]])
def test_cv_server_without_the_server_extra_names_it_and_exits_2(
    fresh_venv: Path, argv: list[str]
) -> None:
    done = _run(fresh_venv, "cv-server", *argv)
    assert done.returncode == 2
    # The line to run, with the pip of the environment that lacks the extra (docs/install.md).
    assert f"{fresh_venv / 'bin' / 'python'} -m pip install 'cv-workspace[server]'" in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


SDK_SCRIPT = """
import asyncio, sys
from cv_mutations import NodeIncrement, NodeInsert
from cv_workspace_client import WorkspaceClient

async def main(url, token):
    async with WorkspaceClient(url, token=token) as client:
        await client.apply_op("ws1", "tree", NodeInsert(node_id="n", parent_id="root"))
        commit = await client.apply_op("ws1", "tree", NodeIncrement(node_id="n", field="k"))
        clock, state = await client.get_state("ws1", "tree")
        print(commit.clock, clock, state.to_json()["nodes"]["n"]["fields"]["k"])

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_the_sdk_without_extras_applies_ops_on_a_real_server(
    fresh_venv: Path, aiohttp_server: object, tmp_path: Path
) -> None:
    app = create_app(ServerConfig(db_path=tmp_path / "server.db", token_secret=SECRET))
    server: TestServer = await aiohttp_server(app)  # type: ignore[operator]
    url = str(server.make_url("")).rstrip("/")
    token = mint_token(SECRET, ["ws1"], now=time.time())
    done = await asyncio.to_thread(_run, fresh_venv, "python", "-c", SDK_SCRIPT, url, token)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "2", "1"]


LOCAL_SERVER_SCRIPT = """
from cv_workspace_client.testing import LocalServer, LocalServerError
try:
    LocalServer().start()
except LocalServerError as exc:
    print(exc.stderr)
"""


def test_local_server_without_the_server_extra_says_which_extra_to_install(
    fresh_venv: Path,
) -> None:
    done = _run(fresh_venv, "python", "-c", LOCAL_SERVER_SCRIPT)
    assert done.returncode == 0, done.stderr
    assert "pip install 'cv-workspace[server]'" in done.stdout
