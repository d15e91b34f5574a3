"""The architecture holds at run time, beside `lint-imports` (docs/architecture.md):

- no module of the three packages imports itself back through any chain of imports, type-only
  (`if TYPE_CHECKING:`) and function-level imports included;
- the pure cores — the one list in `pyproject.toml`'s "pure-cores" contract — load no I/O
  framework when imported for real;
- each import contract of `pyproject.toml` fails when the rule it states is broken.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cv_mutations", "cv_workspace_client", "cv_server")
PYPROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
CONTRACTS: dict[str, dict[str, Any]] = {
    contract["id"]: contract for contract in PYPROJECT["tool"]["importlinter"]["contracts"]
}
#: The modules that must stay free of I/O, read from the same contract `lint-imports` checks.
PURE_MODULES: list[str] = CONTRACTS["pure-cores"]["source_modules"]
#: I/O frameworks a pure module must not load. The contract also forbids `socket`, `selectors`,
#: `subprocess` and `threading` as imports of our code; at run time the standard library itself
#: loads those (`logging` imports `threading`, `email.utils` imports `socket`), so only the
#: frameworks are checked here.
IO_FRAMEWORKS = [
    name
    for name in CONTRACTS["pure-cores"]["forbidden_modules"]
    if name not in {"socket", "selectors", "subprocess", "threading"}
]


def import_cycles(packages: Iterable[str]) -> list[list[str]]:
    """Each group of modules that import one another in a loop (a strongly connected component
    of the import graph, type-only and function-level imports included), sorted."""
    graph = grimp.build_graph(*packages, exclude_type_checking_imports=False)
    edges = {
        module: sorted(graph.find_modules_directly_imported_by(module))
        for module in sorted(graph.modules)
    }
    return strongly_connected(edges)


def strongly_connected(edges: Mapping[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work: list[tuple[str, int]] = [(start, 0)]
        while work:
            node, child = work.pop()
            if child == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            targets = edges.get(node, [])
            if child < len(targets):
                work.append((node, child + 1))
                target = targets[child]
                if target not in index:
                    work.append((target, 0))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return sorted(found)


def test_no_module_of_the_packages_is_part_of_an_import_cycle() -> None:
    assert import_cycles(PACKAGES) == []


def test_the_cycle_check_finds_a_loop_made_only_of_type_only_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "looped"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "leaf.py").write_text("X = 1\n")
    (package / "a.py").write_text(
        textwrap.dedent(
            """
            from typing import TYPE_CHECKING
            from looped import leaf
            if TYPE_CHECKING:
                from looped.b import B
            """
        )
    )
    (package / "b.py").write_text("from looped.a import leaf\nclass B: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles(["looped"]) == [["looped.a", "looped.b"]]


def test_the_pure_cores_listed_in_the_contract_exist_and_load_no_io_framework() -> None:
    # The SDK's __init__ re-exports its shells (it loads the client), so it is replaced by a
    # bare package object: what lands in sys.modules is what the pure modules themselves, and
    # the sub-packages they live in, need. The server's __init__ loads nothing until asked.
    code = textwrap.dedent(
        f"""
        import importlib, json, pkgutil, sys, types
        package = types.ModuleType("cv_workspace_client")
        package.__path__ = [{str(ROOT / "cv_workspace_client")!r}]
        sys.modules["cv_workspace_client"] = package
        loaded = []
        for name in {PURE_MODULES!r}:
            module = importlib.import_module(name)
            loaded.append(name)
            for info in pkgutil.walk_packages(getattr(module, "__path__", []), name + "."):
                importlib.import_module(info.name)
                loaded.append(info.name)
        io = sorted(m for m in sys.modules if m.split(".")[0] in {IO_FRAMEWORKS!r})
        print(json.dumps({{"loaded": loaded, "io": io}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result["io"] == []
    # The SDK's core is named as a folder: every module in it is checked.
    core = sorted(p.stem for p in (ROOT / "cv_workspace_client" / "_core").glob("[!_]*.py"))
    assert core, "the SDK's core folder is empty"
    assert {f"cv_workspace_client._core.{name}" for name in core} <= set(result["loaded"])


# One deliberate violation per contract: (contract id, file appended to, the import that breaks it).
VIOLATIONS = [
    ("mutations-alone", "cv_mutations/ops.py", "import cv_server.config"),
    ("sdk-server-apart", "cv_workspace_client/config.py", "import cv_server.config"),
    ("pure-cores", "cv_workspace_client/_core/machine.py", "import asyncio"),
    ("no-cycles", "cv_workspace_client/_core/url.py", "import cv_workspace_client.client"),
    ("stores-below-edge", "cv_server/sqlite/locks.py", "import cv_server.http.problems"),
    ("drivers-in-adapters", "cv_server/hub.py", "import sqlite3"),
    ("no-test-helpers", "cv_workspace_client/stages/demo.py", "import cv_workspace_client.testing"),
]


def test_every_import_contract_is_broken_by_a_deliberate_violation(tmp_path: Path) -> None:
    assert {contract_id for contract_id, _, _ in VIOLATIONS} == set(CONTRACTS)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    lint = [str(Path(sys.executable).parent / "lint-imports"), "--no-logo", "--no-cache"]

    def run() -> subprocess.CompletedProcess[str]:
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)}
        return subprocess.run(lint, cwd=tmp_path, env=env, capture_output=True, text=True)

    clean = run()
    assert clean.returncode == 0, clean.stdout + clean.stderr
    for _, path, line in VIOLATIONS:
        with (tmp_path / path).open("a") as file:
            file.write(f"\n{line}  # a deliberate violation\n")
    broken = run()
    assert broken.returncode == 1, broken.stdout + broken.stderr
    for contract_id in CONTRACTS:
        assert f"{CONTRACTS[contract_id]['name']} BROKEN" in broken.stdout, contract_id


#: A path of the repository as the code, the docs and the tests name it in prose.
_NAMED_PATH = re.compile(
    r"(?<![\w/.-])((?:cv_mutations|cv_workspace_client|cv_server|tests|docs|bench|examples"
    r"|scripts|schemas)/[\w/.-]*\w\.(?:py|md|json|sql|mjs))"
)


def test_every_file_the_code_docs_and_tests_name_exists() -> None:
    # A module or a test that moves leaves no reference to its old room behind. The changelog
    # tells history, so it may name what is gone.
    tracked = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.toml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert len(tracked) > 100
    missing = sorted(
        f"{source}: {named}"
        for source in tracked
        if source != "CHANGELOG.md"
        for named in _NAMED_PATH.findall((ROOT / source).read_text(encoding="utf-8"))
        if not (ROOT / named).exists()
    )
    assert missing == []
