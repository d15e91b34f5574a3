"""openapi-python-client, as a Python user runs it on the server's own `/openapi.json`: it
generates a client without a single warning, and that client, imported and used against the real
server on loopback, parses a success and the problems (403, 422) with their stable `code`.

Problem answers were `allOf: [ProblemDetails, {status: const}, {code: enum}]`, which the
generator could not merge (169 warnings, every error answer `parsed=None`); they are a plain
`ProblemDetails` now (docs/observability.md, "The API document")."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from cv_server import ServerConfig
from tests.outside.served_document import fetch_document, run
from tests.server.conftest import SECRET, token_for
from tests.server.wire import Served, served

pytestmark = pytest.mark.integration

#: The package name the generator derives from the document's title.
PACKAGE = "cv_workspace_server_client"


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Served]:
    async with served(ServerConfig(db_path=tmp_path / "cv.db", token_secret=SECRET)) as running:
        yield running


@pytest.fixture
def importable(tmp_path: Path) -> Iterator[Callable[[Path, str], ModuleType]]:
    """Import a generated package from its folder; forgotten again after the test."""
    added: list[str] = []

    def load(folder: Path, name: str) -> ModuleType:
        sys.path.insert(0, str(folder))
        added.append(str(folder))
        return importlib.import_module(name)

    yield load
    for folder in added:
        sys.path.remove(folder)
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]


async def test_the_served_document_generates_a_client_that_parses_every_answer_and_code(
    server: Served,
    tmp_path: Path,
    python_tool: Callable[[str], Path],
    importable: Callable[[Path, str], ModuleType],
) -> None:
    generator = python_tool("openapi-python-client")
    document = await fetch_document(server, tmp_path)
    out = tmp_path / "generated"
    # The virtualenv's bin first, as in an activated one: the generator formats with ruff.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    ran = await run(
        [generator, "generate", "--path", document, "--output-path", out],
        cwd=tmp_path,
        env={"PATH": path},
    )
    assert ran.returncode == 0, ran.output
    assert "warning" not in ran.output.lower(), ran.output
    assert "Cannot parse" not in ran.output, ran.output
    assert "not in PATH" not in ran.output, ran.output

    generated = importable(out, PACKAGE)
    post_ops: Any = importlib.import_module(f"{PACKAGE}.api.op_log.post_ops")
    models: Any = importlib.import_module(f"{PACKAGE}.models")
    base_url = f"http://127.0.0.1:{server.port}"

    def body(ops: list[dict[str, Any]]) -> Any:
        return models.ApplyBody.from_dict({"ops": ops})

    insert = {"type": "node.insert", "node_id": "a", "parent_id": "root"}
    async with generated.AuthenticatedClient(base_url=base_url, token=token_for("ws1")) as client:
        ok = await post_ops.asyncio_detailed("ws1", "tree", client=client, body=body([insert]))
        assert ok.status_code == 200
        assert isinstance(ok.parsed, models.ApplyResults)
        assert ok.parsed.results[0].clock == 1

        empty = await post_ops.asyncio_detailed("ws1", "tree", client=client, body=body([]))
        assert empty.status_code == 422
        assert isinstance(empty.parsed, models.ProblemDetails)
        assert empty.parsed.code == "invalid_field"
        assert empty.parsed.status == 422

    async with generated.AuthenticatedClient(base_url=base_url, token=token_for("other")) as client:
        refused = await post_ops.asyncio_detailed("ws1", "tree", client=client, body=body([insert]))
        assert refused.status_code == 403
        assert isinstance(refused.parsed, models.ProblemDetails)
        assert refused.parsed.code == "forbidden_workspace"
