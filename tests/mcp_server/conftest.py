"""The client's fixtures (the real server on loopback, its URL, a token) for the MCP tools."""

from tests.client.conftest import server, server_url, token

__all__ = ["server", "server_url", "token"]
