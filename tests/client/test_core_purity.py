"""The sans-I/O core imports no I/O: no asyncio, aiohttp, websockets, sqlite3 (STYLE habit 1)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import cv_workspace_client

CORE_MODULES = [
    "_liveness",
    "_machine",
    "_machine_effects",
    "_machine_wire",
    "_optimistic",
    "_subscription",
    "errors",
    "models",
]
IO_MODULES = ("asyncio", "aiohttp", "websockets", "sqlite3", "tenacity")
#: Also banned as direct imports (the stdlib pulls some of them in under pydantic regardless).
DIRECT_BANS = {*IO_MODULES, "socket", "threading", "random", "time"}
PACKAGE_DIR = Path(cv_workspace_client.__file__).parent


def test_core_modules_import_nothing_that_does_io_directly() -> None:
    for name in CORE_MODULES:
        tree = ast.parse((PACKAGE_DIR / f"{name}.py").read_text())
        imported: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
        assert not imported & DIRECT_BANS, (name, imported)


def test_core_modules_pull_in_no_io_framework_transitively() -> None:
    # The package's __init__ re-exports the asyncio shell, so load the core modules under a bare
    # package object: what ends up in sys.modules is then what the core itself needs.
    code = (
        "import sys, types\n"
        "pkg = types.ModuleType('cv_workspace_client')\n"
        f"pkg.__path__ = [{str(PACKAGE_DIR)!r}]\n"
        "sys.modules['cv_workspace_client'] = pkg\n"
        + "".join(f"import cv_workspace_client.{name}\n" for name in CORE_MODULES)
        + f"bad = [m for m in {IO_MODULES!r} if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
