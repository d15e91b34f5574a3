"""The queue's rules and seams do no I/O (STYLE habit 1): checked on their import statements,
since importing `cv_server` itself loads the server."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cv_server.queue

PACKAGE = Path(cv_server.queue.__file__).parent
PURE_MODULES = ["model.py", "errors.py", "idempotency.py", "blobs.py", "store.py"]
ALLOWED = {
    "__future__",
    "abc",
    "builtins",
    "collections",
    "dataclasses",
    "hashlib",
    "json",
    "logging",
    "math",
    "typing",
    "cv_server.config",
    "cv_server.queue.errors",
    "cv_server.queue.idempotency",
    "cv_server.queue.model",
}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_queue_modules_import_no_io(module: str) -> None:
    imports = imported_modules(PACKAGE / module)
    outside = {
        name for name in imports if name.split(".")[0] not in ALLOWED and name not in ALLOWED
    }
    assert outside == set()
    assert imports  # the check read real code


def test_the_package_exports_what_it_documents() -> None:
    for name in cv_server.queue.__all__:
        assert hasattr(cv_server.queue, name), name
