"""Fixtures of the outside-client tests: tools nobody on the project wrote, run against the real
server as users run them (the MCP Inspector's CLI, openapi-python-client, openapi-typescript with
openapi-fetch and `tsc`, Redocly's linter).

The Node tools come from this directory's `package.json` (`npm ci` here; `.ci/run` does it). A
test whose tool is missing skips, unless `CV_REQUIRE_OUTSIDE_TOOLS=1` (CI sets it: there a missing
tool is an error, never a skip).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

HERE = Path(__file__).parent
NODE_BIN = HERE / "node_modules" / ".bin"


def _need(path: Path | None, what: str) -> Path:
    if path is not None and path.exists():
        return path
    message = f"{what} is not installed"
    if os.environ.get("CV_REQUIRE_OUTSIDE_TOOLS") == "1":
        pytest.fail(f"CV_REQUIRE_OUTSIDE_TOOLS=1 but {message}")
    pytest.skip(message)


@pytest.fixture
def node_tool() -> Callable[[str], Path]:
    """`node_tool("tsc")`: the path of a Node tool installed by `npm ci` in tests/outside."""

    def find(name: str) -> Path:
        if shutil.which("node") is None:
            _need(None, "node")
        return _need(NODE_BIN / name, f"{name} (npm ci in tests/outside)")

    return find


@pytest.fixture
def python_tool() -> Callable[[str], Path]:
    """`python_tool("openapi-python-client")`: a console script of this virtualenv (dev extra)."""

    def find(name: str) -> Path:
        found = shutil.which(name, path=str(Path(sys.executable).parent))
        return _need(Path(found) if found else None, f"{name} (the dev extra)")

    return find
