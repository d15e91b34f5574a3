"""The seeded fault schedule of a chaos run: pure, so a seed names one run exactly.

Each fault kind has its own mean interval; its faults arrive as a Poisson process (exponential
gaps) over the run, each aimed at one target drawn from the same generator. Executors run one
kind's faults in order (a restart finishes before that kind's next fault), kinds concurrently.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

__all__ = ["KILLS", "Fault", "FaultKind", "Profile", "schedule"]

FaultKind = Literal[
    "kill_server",  # SIGKILL of a server instance, restarted on the same database and port
    "kill_writer",  # SIGKILL of an SDK writer process, restarted on its outbox
    "kill_worker",  # SIGKILL of a cv-worker process, restarted on its outbox
    "term_worker",  # SIGTERM of a cv-worker (it drains), restarted
    "cut_writers",  # every open writer connection cut at its next server chunk
    "drop_subscribers",  # every subscriber connection reset at once
    "kill_backends",  # pg_terminate_backend of every connection of one instance (PostgreSQL)
]

#: The kinds that are process kills (SIGKILL), counted together in the figure line.
KILLS: Final = frozenset({"kill_server", "kill_writer", "kill_worker"})


@dataclass(frozen=True, slots=True)
class Fault:
    #: Seconds after the start of the fault phase.
    at: float
    kind: FaultKind
    #: Index of the target among its kind's processes (server instance, writer or worker).
    target: int


@dataclass(frozen=True, slots=True)
class Profile:
    """Mean seconds between two faults of each kind (None: that kind is off)."""

    every: Mapping[FaultKind, float | None]

    def mean(self, kind: FaultKind) -> float | None:
        return self.every.get(kind)


def schedule(
    seed: int,
    seconds: float,
    profile: Profile,
    targets: Mapping[FaultKind, int],
) -> list[Fault]:
    """Every fault of a run of `seconds`, in time order. `targets[kind]` is how many processes
    a fault of that kind may hit (0 or missing: the kind is not scheduled)."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    for kind in sorted(profile.every):  # a fixed order: the draws must not depend on dict order
        mean, count = profile.mean(kind), targets.get(kind, 0)
        if mean is None or count <= 0:
            continue
        at = rng.expovariate(1 / mean)
        while at < seconds:
            faults.append(Fault(round(at, 3), kind, rng.randrange(count)))
            at += rng.expovariate(1 / mean)
    faults.sort(key=lambda f: (f.at, f.kind, f.target))
    return faults
