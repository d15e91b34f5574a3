"""The replay test of docs/client.md ("Testing your app") runs as written in an app of its own:
a directory outside the repository, a fresh virtualenv with the wheel installed with its
`server` extra (as `pip install 'cv-workspace[server]'`), pytest and pytest-asyncio, and no
conftest: the `cv_server` fixture comes from the installed package's plugin."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.installed import ROOT, install_wheel, run_in

pytestmark = pytest.mark.acceptance

APP_PYPROJECT = """\
[project]
name = "an-app"
version = "0"

[tool.pytest.ini_options]
asyncio_default_fixture_loop_scope = "function"
"""


def _the_example() -> str:
    """The first Python block of the "Testing your app" section."""
    page = (ROOT / "docs" / "client.md").read_text(encoding="utf-8")
    section = page.split("\n## Testing your app\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found is not None, "docs/client.md: 'Testing your app' has no Python example"
    return found.group(1)


@pytest.fixture(scope="module")
def app_venv(sdk_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("app-env")
    return install_wheel(sdk_wheel, work, extras=["server"], also=["pytest", "pytest-asyncio"])


def test_the_docs_replay_test_passes_in_an_app_installed_from_the_wheel(
    app_venv: Path, tmp_path: Path
) -> None:
    app = tmp_path / "an-app"
    (app / "tests").mkdir(parents=True)
    (app / "pyproject.toml").write_text(APP_PYPROJECT)
    (app / "tests" / "test_replay.py").write_text(_the_example())
    where = run_in(app_venv, "python", "-c", "import cv_workspace_client as m; print(m.__file__)")
    assert where.returncode == 0, where.stderr
    assert not Path(where.stdout.strip()).is_relative_to(ROOT)  # the wheel's, not the checkout's
    done = run_in(app_venv, "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=app)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
