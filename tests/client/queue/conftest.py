"""The worker's fixtures (a real server in-process on loopback, made to order) for the tests of
the SDK's queue calls, which share the worker's tokens and helpers."""

from tests.worker.conftest import make_server, server

__all__ = ["make_server", "server"]
