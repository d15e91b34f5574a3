"""The stage worker: claims requests, runs each stage's handler, reports (docs/stages.md).

The room: `runner` (the `Worker` and its loop), `io` (heartbeats and completions on the wire),
`report` (what a finished run tells the queue), `outcome` (answer or failure, pure), `parts`
(single-flight, the stage result cache, the run meter) and `stats` (the counters).
"""

from __future__ import annotations

from cv_workspace_client.worker.runner import Worker, WorkerConfig
from cv_workspace_client.worker.stats import WorkerStats

__all__ = ["Worker", "WorkerConfig", "WorkerStats"]
