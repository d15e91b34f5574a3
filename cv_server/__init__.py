"""cv_server: the op-log server, work queue and compute lock (docs/concepts.md, docs/protocol.md,
docs/queue.md, docs/stages.md)."""

from cv_server.app import create_app
from cv_server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
