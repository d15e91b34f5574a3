"""When to try a read-modify-write again after a `version_conflict` (docs/ops.md#conflicts),
without I/O: the policy and the delays it gives. `WorkspaceClient.read_modify_write` is the
asyncio shell (its `sleep` and `uniform` are injectable).

Seed numbers, as the server's serialization retry reads them: three backoffs (25, 50, 100 ms),
each multiplied by a factor drawn uniformly from [0.5, 1.5], one before each of three retries,
so the change runs at most four times. The jitter keeps writers that lost one race from meeting
again on the next.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["ConflictRetryPolicy", "conflict_delays"]


@dataclass(frozen=True, slots=True)
class ConflictRetryPolicy:
    """How `read_modify_write` retries a conflict (docs/configuration.md); tests shrink it."""

    #: One backoff per retry, in seconds: its length is the number of retries.
    backoffs: tuple[float, ...] = (0.025, 0.050, 0.100)
    #: Each backoff is multiplied by a factor drawn uniformly from this range.
    jitter: tuple[float, float] = (0.5, 1.5)

    def __post_init__(self) -> None:
        if any(b < 0 for b in self.backoffs):
            raise ValueError("conflict backoffs must be >= 0")
        low, high = self.jitter
        if not 0 <= low <= high:
            raise ValueError("conflict jitter must be a range (low, high) with 0 <= low <= high")

    @property
    def max_runs(self) -> int:
        """How many times the change may run: the first try plus one per backoff."""
        return len(self.backoffs) + 1


def conflict_delays(
    policy: ConflictRetryPolicy, uniform: Callable[[float, float], float] = random.uniform
) -> Iterator[float]:
    """The wait before each retry, in order; exhausted means "give up, raise the conflict"."""
    low, high = policy.jitter
    for backoff in policy.backoffs:
        yield backoff * uniform(low, high)
