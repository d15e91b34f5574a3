"""`cv-workspace mcp`: an MCP server over the SDK, for agents (docs/mcp.md; the `mcp` extra).

The room: `server` (the tools and how each is served), `answers` (errors as tool results),
`feeds` (subscriptions an agent reads in pages) and `transports` (stdio and streamable HTTP).
"""

from __future__ import annotations

from cv_workspace_client.mcp_server.server import (
    DRAIN_SECONDS,
    MAX_WAIT_SECONDS,
    TOOL_NAMES,
    ListenFailed,
    build_server,
    serve_http,
    serve_stdio,
)

__all__ = [
    "DRAIN_SECONDS",
    "MAX_WAIT_SECONDS",
    "TOOL_NAMES",
    "ListenFailed",
    "build_server",
    "serve_http",
    "serve_stdio",
]
