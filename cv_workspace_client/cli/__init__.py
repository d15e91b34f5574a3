"""The two commands, `cv-worker` and `cv-workspace` (docs/stages.md, docs/queue.md).

Also runnable as `python -m cv_workspace_client.cli worker|workspace ARGS`.
"""

from __future__ import annotations

from cv_workspace_client.cli.workspace import EXIT_CODES, load_stages, worker_main, workspace_main

__all__ = ["EXIT_CODES", "load_stages", "worker_main", "workspace_main"]
