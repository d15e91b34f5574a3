"""openapi-typescript and openapi-fetch, as a TypeScript user runs them on the server's own
`/openapi.json`, with their default options: the types they generate compile an ordinary
enqueue and an apply of one `node.insert` (`typescript/calls.ts`) under `tsc --noEmit --strict`.

Optional members carried `"default": null` (or `false`, `{}`), which openapi-typescript reads as
"always present": the calls did not compile until every optional member was written out. The
published schemas carry no default on an optional member (cv_mutations.schema)."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from cv_server import ServerConfig
from tests.outside.served_document import fetch_document, run
from tests.server.conftest import SECRET
from tests.server.wire import Served, served

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Served]:
    async with served(ServerConfig(db_path=tmp_path / "cv.db", token_secret=SECRET)) as running:
        yield running


async def test_generated_types_compile_an_enqueue_and_a_node_insert_with_default_options(
    server: Served, tmp_path: Path, node_tool: Callable[[str], Path]
) -> None:
    generate, tsc = node_tool("openapi-typescript"), node_tool("tsc")
    document = await fetch_document(server, tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    for name in ("calls.ts", "tsconfig.json"):
        shutil.copy(HERE / "typescript" / name, project / name)
    # Where `import "openapi-fetch"` finds the pinned package, as in a user's own project.
    (project / "node_modules").symlink_to(HERE / "node_modules", target_is_directory=True)

    generated = await run([generate, document, "--output", project / "api.d.ts"], cwd=project)
    assert generated.returncode == 0, generated.output
    compiled = await run([tsc, "--project", project / "tsconfig.json"], cwd=project)
    assert compiled.returncode == 0, compiled.output
