"""cv_server: the op-log server, work queue and compute lock (DESIGN §4, §5, §7, §8)."""

from cv_server.app import create_app
from cv_server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
