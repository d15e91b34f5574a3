"""The two commands, `cv-worker` and `cv-workspace` (docs/stages.md, docs/queue.md).

- `worker`: `cv-worker`, which runs stage handlers until SIGTERM/SIGINT, then drains.
- `stages_module`: the module `cv-worker --stages pkg.module:STAGES` names, imported.
- `workspace`: `cv-workspace` and its subcommands (`enqueue`, `requests ...`, `mcp`).
- `progress`: what `cv-workspace` tells a terminal while it waits.
- `connection`: `--url`, `--token` and `--token-file`, as both commands take them.
- `conventions`: what both share: the exit statuses (`EXIT_CODES`), one error style, output.

A flag backed by an environment variable names it at the end of its help (`(env: CV_URL)`); a
flag given wins over it (docs/configuration.md). Also runnable as `python -m
cv_workspace_client.cli worker|workspace ARGS` (`__main__`). The modules here import each other,
never this package, which only re-exports.
"""

from __future__ import annotations

from cv_workspace_client.cli.conventions import EXIT_CODES
from cv_workspace_client.cli.stages_module import load_stages
from cv_workspace_client.cli.worker import worker_main
from cv_workspace_client.cli.workspace import workspace_main

__all__ = ["EXIT_CODES", "load_stages", "worker_main", "workspace_main"]
