"""The server fixtures (a real app on loopback, both backends) for the observability tests."""

from tests.server.conftest import client, make_config, make_server_config

__all__ = ["client", "make_config", "make_server_config"]
