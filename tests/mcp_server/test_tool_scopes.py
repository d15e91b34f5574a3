"""The MCP server offers only the tools its token allows, and its instructions name the others
and the scope each needs (docs/mcp.md, "Tools and scopes"): in process, over a real server."""

from __future__ import annotations

import time

from mcp import Client

from cv_server.auth import mint_token
from cv_workspace_client import WorkspaceClient
from cv_workspace_client.mcp_server import TOOL_NAMES, build_server
from tests.client.helpers import SECRET, WS


async def offered(server_url: str, token: str) -> tuple[set[str], str]:
    async with WorkspaceClient(server_url, token=token) as sdk:
        server, feeds = build_server(sdk)
        try:
            async with Client(server) as client:
                names = {tool.name for tool in (await client.list_tools()).tools}
                return names, client.instructions or ""
        finally:
            await feeds.close()


async def test_a_read_only_token_offers_only_the_read_tools_and_says_why(
    server_url: str,
) -> None:
    token = mint_token(SECRET, [WS], now=time.time(), scopes=["read"])
    names, instructions = await offered(server_url, token)
    assert names == {"get_state", "read_ops"}
    assert "enqueue (needs the enqueue scope)" in instructions
    assert "list_requests (needs the operate scope)" in instructions
    assert "get_state" not in instructions.partition("does not offer")[2]


async def test_an_enqueue_token_offers_the_request_tools_but_not_the_operator_ones(
    server_url: str,
) -> None:
    token = mint_token(SECRET, [WS], now=time.time(), scopes=["enqueue"])
    names, _ = await offered(server_url, token)
    assert names == {
        "enqueue",
        "get_request",
        "wait_request",
        "cancel_request",
        "add_schedule",
        "list_schedules",
        "pause_schedule",
        "resume_schedule",
        "delete_schedule",
        "run_schedule",
    }


async def test_a_token_with_every_scope_offers_every_tool(server_url: str, token: str) -> None:
    names, instructions = await offered(server_url, token)
    assert names == set(TOOL_NAMES)
    assert "does not offer" not in instructions
