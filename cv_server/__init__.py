"""cv_server: the op-log server, work queue and compute lock (DESIGN §4, §5, §7, §8)."""

__all__: list[str] = []
