"""What a strict MCP client accepts from the MCP tools (`cv_workspace_client.mcp_server`, the
error contract of docs/mcp.md): a tool error is `isError` with its code in text content and no
structured content, every successful result matches its tool's `outputSchema`, and
`serverInfo.version` is the package's.

"Strict" is the MCP TypeScript SDK's client (the MCP Inspector's): it checks any
`structuredContent` against the tool's `outputSchema`, an error result's too. `strictly` below
applies that rule with `jsonschema`; the Inspector itself is run in
tests/outside/test_mcp_inspector.py.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from jsonschema import Draft202012Validator
from mcp import Client
from mcp_types import CallToolResult, Tool

from cv_server import ServerConfig, create_app
from cv_workspace_client import WorkspaceClient
from cv_workspace_client._queue import holder
from cv_workspace_client.mcp_server import TOOL_NAMES, build_server
from cv_workspace_client.mcp_server.answers import tool_error
from tests.client.conftest import ServerFactory
from tests.client.helpers import SECRET, WS, token_for


class Strict:
    """An in-process MCP client that reads results as the TypeScript SDK's client does."""

    def __init__(self, client: Client, sdk: WorkspaceClient, tools: dict[str, Tool]) -> None:
        self.client = client
        self.sdk = sdk
        self.tools = tools

    async def result(self, tool: str, **arguments: Any) -> CallToolResult:
        """The call's result, once it passed the strict client's checks."""
        result = await self.client.call_tool(tool, arguments)
        listed = self.tools.get(tool)
        schema = None if listed is None else listed.output_schema
        if schema is not None and result.structured_content is not None:
            found = Draft202012Validator(schema).iter_errors(result.structured_content)
            errors = [error.message for error in found]
            assert errors == [], (tool, result.is_error, errors)
        if schema is not None and not result.is_error:
            assert result.structured_content is not None, tool
        return result

    async def answer(self, tool: str, **arguments: Any) -> dict[str, Any]:
        result = await self.result(tool, **arguments)
        assert not result.is_error, (tool, result.content)
        structured: dict[str, Any] | None = result.structured_content
        assert structured is not None
        return structured

    async def error(self, tool: str, **arguments: Any) -> dict[str, Any]:
        """A tool error's `{"code", "message", ...}`, read from its one text content."""
        result = await self.result(tool, **arguments)
        assert result.is_error, (tool, result.structured_content)
        assert result.structured_content is None, tool
        (text,) = [block.text for block in result.content if block.type == "text"]
        error: dict[str, Any] = json.loads(text)["error"]
        return error


@pytest.fixture
async def server_url(aiohttp_server: ServerFactory, tmp_path: Path) -> str:
    """The real server on loopback, where a request is poison at its first failure."""
    config = ServerConfig(db_path=tmp_path / "server.db", token_secret=SECRET, max_dequeues=1)
    server: TestServer = await aiohttp_server(create_app(config))
    return str(server.make_url("")).rstrip("/")


@contextlib.asynccontextmanager
async def strict_client(server_url: str) -> AsyncIterator[Strict]:
    """Entered in the test's own task: anyio's cancel scopes (the `mcp` client's) must be left
    in the task that entered them, which an async fixture's teardown is not."""
    async with WorkspaceClient(server_url, token=token_for(WS)) as sdk:
        server, feeds = build_server(sdk)
        try:
            async with Client(server) as client:
                tools = {tool.name: tool for tool in (await client.list_tools()).tools}
                yield Strict(client, sdk, tools)
        finally:
            await feeds.close()


async def _finished_request(strict: Strict, stage: str, *, failed: bool) -> str:
    """A request run to `done` (or, failed once, to `poison`) by a claim made here."""
    enqueued = await strict.answer("enqueue", workspace_id=WS, stage=stage)
    (claim,) = await holder.claim(strict.sdk, [stage], "w1")
    request_id = str(enqueued["request_id"])
    if failed:
        await holder.fail(strict.sdk, WS, request_id, claim.claim_token, {"code": "boom"})
    else:
        await holder.complete(strict.sdk, WS, request_id, claim.claim_token, result={"ok": 1})
    return request_id


@pytest.mark.unit
def test_a_tool_error_is_text_content_and_never_structured_content() -> None:
    result = tool_error("forbidden_workspace", "the token does not grant 'x'", op_ids=["op_12345"])

    assert result.is_error
    assert result.structured_content is None
    assert "structuredContent" not in result.model_dump(by_alias=True, exclude_none=True)
    (block,) = result.content
    assert block.type == "text"
    assert json.loads(block.text) == {
        "error": {
            "code": "forbidden_workspace",
            "message": "the token does not grant 'x'",
            "op_ids": ["op_12345"],
        }
    }


async def test_every_kind_of_tool_error_reaches_a_strict_client_with_its_code(
    server_url: str,
) -> None:
    async with strict_client(server_url) as strict:
        done = await _finished_request(strict, "quick", failed=False)
        forbidden = await strict.error("get_state", workspace_id="elsewhere", sub_doc="tree")
        bad_op = await strict.error(
            "apply_ops", workspace_id=WS, sub_doc="tree", ops=[{"type": "node.explode"}]
        )
        refused_write = await strict.error(
            "apply_ops", workspace_id="elsewhere", sub_doc="tree",
            ops=[{"type": "node.insert", "node_id": "a", "parent_id": "root"}],
        )  # fmt: skip
        missing = await strict.error("wait_request", workspace_id=WS)
        too_late = await strict.error("cancel_request", workspace_id=WS, request_id=done)
        unknown = await strict.error("get_request", workspace_id=WS, request_id="d_" + "0" * 40)
        no_tool = await strict.error("drop_everything", workspace_id=WS)

    assert forbidden["code"] == "forbidden_workspace"
    assert bad_op["code"] == "unknown_op_type"
    assert refused_write["code"] == "forbidden_workspace"
    assert refused_write["pending"] is True
    assert len(refused_write["op_ids"]) == 1
    assert missing["code"] == "invalid_arguments"
    assert "request_id" in missing["message"]
    assert too_late["code"] == "not_cancellable"
    assert unknown["code"] == "not_found"
    assert no_tool["code"] == "unknown_tool"


async def test_every_tools_successful_result_matches_its_output_schema(server_url: str) -> None:
    tree = {"workspace_id": WS, "sub_doc": "tree"}
    insert = {"type": "node.insert", "node_id": "a", "parent_id": "root"}
    async with strict_client(server_url) as strict:
        done = await _finished_request(strict, "quick", failed=False)
        poison = await _finished_request(strict, "breaks", failed=True)
        doomed = await _finished_request(strict, "breaks-too", failed=True)
        pending = await strict.answer("enqueue", workspace_id=WS, stage="unserved", input=[1])
        waiting = {"workspace_id": WS, "request_id": pending["request_id"]}
        answers = {
            "apply_ops": await strict.answer("apply_ops", **tree, ops=[insert, insert]),
            "get_state": await strict.answer("get_state", **tree),
            "read_ops": await strict.answer("read_ops", **tree, since=0),
            "enqueue": pending,
            "get_request": await strict.answer("get_request", workspace_id=WS, request_id=done),
            "wait_request": await strict.answer("wait_request", **waiting, timeout_s=0),
            "list_requests": await strict.answer("list_requests", workspace_id=WS),
            "cancel_request": await strict.answer("cancel_request", **waiting),
            "replay_request": await strict.answer(
                "replay_request", workspace_id=WS, request_id=poison
            ),
            "discard_request": await strict.answer(
                "discard_request", workspace_id=WS, request_id=doomed
            ),
            **await _schedule_answers(strict),
        }
        schemas = {name: tool.output_schema for name, tool in strict.tools.items()}

    assert set(answers) == set(TOOL_NAMES)
    assert all(schemas[name] is not None for name in TOOL_NAMES)
    statuses = [r["status"] for r in answers["apply_ops"]["results"]]
    assert statuses == ["committed", "rejected"]  # both arms of an op's outcome
    assert answers["wait_request"]["status"] == "timeout"
    assert answers["get_request"]["result"] == {"ok": 1}
    assert answers["cancel_request"]["status"] == "cancelled"
    assert answers["replay_request"]["status"] == "pending"
    assert (answers["discard_request"]["request_id"], answers["discard_request"]["status"]) == (
        doomed,
        "poison",
    )


async def _schedule_answers(strict: Any) -> dict[str, Any]:
    """A successful answer of each schedule tool, in an order that lets each succeed."""
    named = {"workspace_id": WS, "name": "nightly"}
    answers = {
        "add_schedule": await strict.answer(
            "add_schedule", **named, stage="quick", cron="0 3 * * *", input={"n": 1}
        ),
        "list_schedules": await strict.answer("list_schedules", workspace_id=WS),
        "pause_schedule": await strict.answer("pause_schedule", **named),
        "resume_schedule": await strict.answer("resume_schedule", **named),
        "run_schedule": await strict.answer("run_schedule", **named),
        "delete_schedule": await strict.answer("delete_schedule", **named),
    }
    assert answers["add_schedule"]["schedule"]["cron"] == "0 3 * * *"
    assert [s["name"] for s in answers["list_schedules"]["schedules"]] == ["nightly"]
    assert answers["pause_schedule"]["schedule"]["next_fire_at"] is None
    assert answers["run_schedule"]["request_id"].startswith("s_")
    again = {"stage": "quick", "cron": "0 3 * * *"}
    await strict.answer("add_schedule", **named, **again)  # the name is free once deleted
    assert (await strict.error("add_schedule", **named, **again))["code"] == "schedule_exists"
    gone = await strict.error("pause_schedule", workspace_id=WS, name="nope")
    assert gone["code"] == "schedule_not_found"
    return answers


async def test_server_info_names_the_installed_package_version(server_url: str) -> None:
    async with strict_client(server_url) as strict:
        info = strict.client.server_info

    assert info is not None
    assert info.name == "cv-workspace"
    assert info.version == version("cv-workspace")
