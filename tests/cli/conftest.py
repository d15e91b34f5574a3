"""The worker's fixtures (a real server in-process on loopback, a `WorkspaceClient` on it) for the
commands' tests: `cv-workspace` and `cv-worker` run against the same server."""

from tests.worker.conftest import client, make_server, server

__all__ = ["client", "make_server", "server"]
