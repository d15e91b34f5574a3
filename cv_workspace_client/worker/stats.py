"""`WorkerStats`: what a worker did, counted as it goes. A leaf: the runner and the reporter
both count into it, and neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WorkerStats"]


@dataclass
class WorkerStats:
    """What the worker did; `run()` returns it after the drain."""

    claimed: int = 0
    completed: int = 0
    #: Completed with an error payload: an `ExpectedError`, or a downstream's final refusal.
    expected_errors: int = 0
    failed: int = 0
    cache_hits: int = 0
    shared_runs: int = 0
    leases_lost: int = 0
    #: Stages stopped because someone cancelled their request (reported back: `cancelled`).
    cancelled: int = 0
    #: Stages still running at the drain deadline, cancelled without a report (they re-drive).
    cancelled_at_drain: int = 0

    @property
    def clean(self) -> bool:
        """True if the drain finished every in-flight stage."""
        return self.cancelled_at_drain == 0
