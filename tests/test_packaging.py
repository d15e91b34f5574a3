"""`pip install cv-workspace` without extras, into a fresh virtualenv, offline, from the checkout:
the SDK works against a real server, and `cv-server` names the extra it needs instead of dying
on an import."""

from __future__ import annotations

import importlib.metadata as metadata
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer
from packaging.requirements import Requirement

from cv_server import ServerConfig, create_app
from cv_server.auth import mint_token

ROOT = Path(__file__).resolve().parents[1]
BOUND = 180.0
SECRET = b"packaging-test-secret-0123456789abcdef"


def _closure(names: list[str]) -> set[str]:
    """The installed distributions `names` need to run, themselves included (markers for this
    interpreter honoured, extras not followed)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        dist = metadata.distribution(todo.pop())
        name = dist.metadata["Name"].lower()
        if name in seen:
            continue
        seen.add(name)
        for raw in dist.requires or []:
            requirement = Requirement(raw)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def _base_requirements() -> list[str]:
    """What `cv-workspace` itself requires, without any extra."""
    requires = metadata.distribution("cv-workspace").requires or []
    names = []
    for raw in requires:
        requirement = Requirement(raw)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            names.append(requirement.name)
    return names


def _link_distributions(names: set[str], into: Path) -> None:
    """Symlink each distribution's top-level files (packages, modules, its dist-info) into
    `into`: a site directory holding these and nothing else, as an offline index would."""
    into.mkdir()
    for name in names:
        dist = metadata.distribution(name)
        for file in dist.files or []:
            top = Path(file.parts[0])
            if top.name in ("..", "__pycache__") or top.suffix == ".pth":
                continue
            source = Path(str(dist.locate_file(top)))
            target = into / top.name
            if source.exists() and not target.exists():
                target.symlink_to(source)


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("packaging")
    wheels = work / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(wheels), str(ROOT)],
        check=True, capture_output=True, timeout=BOUND,
    )  # fmt: skip
    venv = work / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        check=True,
        capture_output=True,
        timeout=BOUND,
    )
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
         "--no-deps", "-q", *map(str, wheels.glob("*.whl"))],
        check=True, capture_output=True, timeout=BOUND,
    )  # fmt: skip
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
        timeout=BOUND,
    ).stdout.strip()
    deps = work / "base-dependencies"
    _link_distributions(_closure(_base_requirements()), deps)
    (Path(site) / "base_dependencies.pth").write_text(f"{deps}\n")
    return venv


def _run(venv: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    # From a directory without the checkout in it: the installed wheel is what runs.
    return subprocess.run(
        [str(venv / "bin" / argv[0]), *argv[1:]],
        capture_output=True,
        text=True,
        timeout=BOUND,
        cwd=venv,
        env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin"},
    )


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
    import asyncio

    app = create_app(ServerConfig(db_path=tmp_path / "server.db", token_secret=SECRET))
    server: TestServer = await aiohttp_server(app)  # type: ignore[operator]
    url = str(server.make_url("")).rstrip("/")
    token = mint_token(SECRET, ["ws1"], now=time.time())
    done = await asyncio.to_thread(_run, fresh_venv, "python", "-c", SDK_SCRIPT, url, token)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "2", "1"]
