"""cv_server: the op-log server, work queue and compute lock (docs/concepts.md).

`create_app` and `ServerConfig` are loaded on first use, so that `cv-server` can tell a user who
installed the package without its `server` extra what to install, instead of failing on an
import (tests/test_packaging.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cv_server.app import create_app
    from cv_server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from cv_server.app import create_app

        return create_app
    if name == "ServerConfig":
        from cv_server.config import ServerConfig

        return ServerConfig
    raise AttributeError(f"module 'cv_server' has no attribute {name!r}")
