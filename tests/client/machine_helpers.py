"""Helpers for driving the pure `OutboxMachine` in tests: a deterministic minter, a recording
backoff, and small accessors over the decisions it drains."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, TypeVar

from cv_workspace_client._core.machine import Decision, OutboxMachine, Persist, Send

D = TypeVar("D")


def counting_minter(prefix: str = "op") -> Callable[[], str]:
    counter = itertools.count(1)
    return lambda: f"{prefix}{next(counter):08d}"


def make_machine(**overrides: Any) -> OutboxMachine:
    options: dict[str, Any] = {
        "now": lambda: 1_700_000_000.0,
        "new_op_id": counting_minter(),
        "backoff": lambda failures: float(failures) * 10,
        "max_attempts": 5,
    }
    options.update(overrides)
    return OutboxMachine(**options)


def inc(node: str = "n", field: str = "count") -> dict[str, Any]:
    return {"type": "node.increment", "node_id": node, "field": field, "by": 1}


def of_type(decisions: list[Decision], kind: type[D]) -> list[D]:
    return [d for d in decisions if isinstance(d, kind)]


def persist_all(machine: OutboxMachine) -> list[Decision]:
    """Confirm every pending Persist, return the decisions that followed (sends etc.)."""
    decisions = machine.decisions()
    seqs = [row.seq for persist in of_type(decisions, Persist) for row in persist.rows]
    machine.persisted(seqs)
    return [d for d in decisions if not isinstance(d, Persist)] + machine.decisions()


def commit_results(
    send: Send, first_clock: int, *, duplicate: bool = False
) -> list[dict[str, Any]]:
    return [
        {"op_id": row.op_id, "clock": first_clock + i, "duplicate": duplicate}
        for i, row in enumerate(send.rows)
    ]
