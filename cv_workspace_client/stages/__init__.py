"""Example stages (docs/stages.md), written against `StageContext`: run them with
`cv-worker --stages cv_workspace_client.stages:STAGES --provider openai --provider-url URL`.

- `evaluate`: one provider call per custom column of a job, each under
  `compute_lock(job, "eval:<col>")`, written as a `node.update` of the job's node in `jobs`.
- `enrich`: one provider call per job for its commute (`commute_minutes`), under
  `compute_lock(job, "enrich:commute")`.

`fake_provider` is a counting OpenAI-compatible endpoint for demos and tests.
"""

from __future__ import annotations

from typing import Final

from cv_workspace_client.stage import Stage
from cv_workspace_client.stages.enrich import enrich
from cv_workspace_client.stages.evaluate import evaluate, make_evaluate
from cv_workspace_client.stages.jobs import JOBS, ComputeLockedError, ProviderMissingError

__all__ = [
    "JOBS",
    "STAGES",
    "ComputeLockedError",
    "ProviderMissingError",
    "enrich",
    "evaluate",
    "make_evaluate",
]

#: What `cv-worker --stages cv_workspace_client.stages:STAGES` runs.
STAGES: Final[dict[str, Stage]] = {
    "evaluate": Stage(evaluate),
    "enrich": Stage(enrich),
}
