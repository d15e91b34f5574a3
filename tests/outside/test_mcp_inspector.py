"""The official MCP Inspector's CLI (`mcp-inspector --cli`, tests/outside/package.json) driving
`cv-workspace mcp` (docs/mcp.md) over stdio and over streamable HTTP, against the real `cv-server`
on loopback: a tool error's code reaches the Inspector's output; a successful call's structured
result passes its check against the tool's `outputSchema`; the tools' schemas have no
portability error (`--strict`); and `serverInfo` names the package's version.

The Inspector is built on the MCP TypeScript SDK, which checks any `structuredContent` against
the tool's `outputSchema`, an error result's too: a tool error's code reaching it pins that tool
errors carry their code in text content only (docs/mcp.md#errors).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from cv_workspace_client.mcp_server import TOOL_NAMES
from tests.acceptance.procs import ServerProcess, free_port, mint_cli_token
from tests.acceptance.three_layers_procs import Proc

pytestmark = pytest.mark.acceptance

WS = "inspected"
#: The Inspector CLI's exit status for a result with `isError: true` (`tool_is_error`).
TOOL_IS_ERROR = 5
#: Bound on one Inspector run (it starts Node, and over stdio the MCP server too).
RUN_S = 90


@dataclass(frozen=True)
class Deployment:
    url: str
    token_file: Path
    log_dir: Path


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("inspector")
    db = tmp / "cv.db"
    token_file = tmp / "token"
    token_file.write_text(mint_cli_token(db, WS) + "\n")
    server = ServerProcess(db, free_port(), tmp / "server.log")
    server.start()
    try:
        yield Deployment(server.url, token_file, tmp)
    finally:
        server.stop()


def _mcp_flags(deployment: Deployment) -> list[str]:
    return ["--url", deployment.url, "--token-file", str(deployment.token_file)]


@dataclass(frozen=True)
class Inspector:
    """`mcp-inspector --cli` aimed at one MCP server: `target` is the stdio command or the
    `--transport http --server-url` pair; its catalog and client config stay in `home`."""

    transport: str
    binary: Path
    target: list[str]
    home: Path

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        """One Inspector run (`--format json --quiet`): stdout holds the result, stderr the
        error envelope."""
        return subprocess.run(
            [str(self.binary), "--cli", *self.target, *args, "--format", "json", "--quiet"],
            capture_output=True,
            text=True,
            timeout=RUN_S,
            env={
                **os.environ,
                "HOME": str(self.home),
                "MCP_CATALOG_PATH": str(self.home / "catalog.json"),
                "MCP_CLIENT_CONFIG_PATH": str(self.home / "client.json"),
            },
        )

    def call(
        self, tool: str, *options: str, exit_status: int = 0, **arguments: Any
    ) -> dict[str, Any]:
        """The `tools/call` result as the Inspector printed it. It exits 0 on a successful
        result, 5 on a tool error (the result still printed), and 1 with only an error on
        stderr when it cannot accept the result (one failing its `outputSchema`)."""
        args = [f"{key}={json.dumps(value)}" for key, value in arguments.items()]
        run = self.run(*options, "--method", "tools/call", "--tool-name", tool, "--tool-arg", *args)
        assert run.returncode == exit_status, (tool, run.returncode, run.stdout, run.stderr)
        printed: dict[str, Any] = json.loads(run.stdout)["result"]
        return printed

    def error_of(self, tool: str, **arguments: Any) -> dict[str, Any]:
        """The `{"code", "message", ...}` of a tool error, read from its text content."""
        result = self.call(tool, exit_status=TOOL_IS_ERROR, **arguments)
        assert result["isError"] is True, result
        assert "structuredContent" not in result, result
        (text,) = [block["text"] for block in result["content"] if block["type"] == "text"]
        error: dict[str, Any] = json.loads(text)["error"]
        return error


@pytest.fixture
def stdio_inspector(
    deployment: Deployment,
    node_tool: Callable[[str], Path],
    python_tool: Callable[[str], Path],
    tmp_path: Path,
) -> Inspector:
    command = [str(python_tool("cv-workspace")), "mcp", *_mcp_flags(deployment)]
    return Inspector("stdio", node_tool("mcp-inspector"), command, tmp_path)


@pytest.fixture
def http_inspector(
    deployment: Deployment, node_tool: Callable[[str], Path], tmp_path: Path
) -> Iterator[Inspector]:
    binary = node_tool("mcp-inspector")
    args = ["-m", "cv_workspace_client.cli", "workspace", "mcp", *_mcp_flags(deployment),
            "--transport", "http", "--port", "0"]  # fmt: skip
    server = Proc(args, deployment.log_dir / "mcp-http.log", "listening on")
    server.start()
    try:
        yield Inspector(
            "http", binary, ["--transport", "http", "--server-url", server.url], tmp_path
        )
    finally:
        server.stop()


@pytest.fixture(params=["stdio", "http"])
def inspector(request: pytest.FixtureRequest) -> Inspector:
    found: Inspector = request.getfixturevalue(f"{request.param}_inspector")
    return found


def test_a_forbidden_workspace_reaches_the_inspector_as_its_code(inspector: Inspector) -> None:
    error = inspector.error_of("get_state", workspace_id="elsewhere", sub_doc="tree")

    assert error["code"] == "forbidden_workspace"
    assert "elsewhere" in error["message"]


def test_an_unknown_op_type_reaches_the_inspector_as_its_code(inspector: Inspector) -> None:
    error = inspector.error_of(
        "apply_ops", workspace_id=WS, sub_doc="tree", ops=[{"type": "node.explode"}]
    )

    assert error["code"] == "unknown_op_type"
    assert error["message"].startswith("ops[0]: ")


def test_a_successful_call_passes_the_inspectors_output_schema_check(
    inspector: Inspector,
) -> None:
    sub_doc = f"ok-{inspector.transport}"
    applied = inspector.call(
        "apply_ops",
        workspace_id=WS,
        sub_doc=sub_doc,
        ops=[{"type": "node.insert", "node_id": "a", "parent_id": "root"}],
    )
    state = inspector.call("get_state", workspace_id=WS, sub_doc=sub_doc)

    assert applied["isError"] is False
    assert applied["structuredContent"]["results"][0]["status"] == "committed"
    assert state["isError"] is False
    assert state["structuredContent"]["workspace_id"] == WS
    assert state["structuredContent"]["state"]["nodes"]["a"]["parent"] == "root"


def test_the_inspector_finds_no_portability_error_in_the_tool_schemas(
    inspector: Inspector,
) -> None:
    # `--strict` exits 6 on an error-severity problem in a tool's schemas; the free-form JSON
    # members (`state`, `input`, `result`) are warnings, as they are meant: any JSON.
    run = inspector.run("--method", "tools/list", "--strict")

    assert run.returncode == 0, run.stderr
    assert {tool["name"] for tool in json.loads(run.stdout)["result"]["tools"]} == set(TOOL_NAMES)


def test_the_inspector_is_told_the_package_version(inspector: Inspector) -> None:
    # A 2026-07-28 connection stamps the server's `serverInfo` on each result (`_meta`).
    result = inspector.call(
        "get_state", "--protocol-era", "modern", workspace_id=WS, sub_doc="tree"
    )

    server_info = result["_meta"]["io.modelcontextprotocol/serverInfo"]
    assert server_info == {"name": "cv-workspace", "version": version("cv-workspace")}
