"""Every invariant of a chaos run, checked over what the run recorded: pure, so each check is
tested on a history made to break it (`tests/chaos/test_invariants.py`).

The promise, as checked here:

- every acknowledged op is in the log (`lost` counts those that are not), every op a writer
  intended is in the log (`missing`: gaps in a writer's plan prefix), none twice
  (`duplicates`), each writer's ops to a sub-doc in its order; the counters equal the
  increments logged and each leaf sits where its last logged move put it;
- each sub-doc's clocks are 1..n;
- each subscriber saw each clock exactly once, in order (what it saw is the log);
- every request ended done, cancelled or poison; an Idempotency-Key was always answered with one
  request id; no cell was computed by two requests or written twice, and every cell of a job
  with a done request is written;
- the provider was paid at most once per cell, plus once per worker killed (one killed
  mid-call is paid again by the next claimant);
- every outbox is empty at the end.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.chaos.plan import DOCS, op_for, parse_op_id
from tests.chaos.schedule import KILLS

__all__ = ["Entry", "History", "RequestRecord", "Verdict", "check"]

#: (clock, op_id, op as JSON) of one log entry.
Entry = tuple[int, str | None, dict[str, Any]]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: str
    job_id: str
    status: str
    #: Cell names (`eval:<col>`) this request computed itself.
    computed: tuple[str, ...] = ()


@dataclass
class History:
    """What a run recorded (the harness fills it in at the end)."""

    #: Each sub-doc's log, the writers' sub-docs and the jobs sub-doc.
    logs: dict[str, list[Entry]]
    jobs_doc: str
    #: Each writer sub-doc's state (`SubDocState.to_json()`).
    states: dict[str, dict[str, Any]]
    #: op_ids each writer saw acknowledged.
    acked: dict[int, set[str]]
    #: (subscriber, sub-doc) -> the (clock, op_id) it was handed, duplicates included.
    seen: dict[tuple[str, str], list[tuple[int, str | None]]]
    requests: list[RequestRecord]
    #: Idempotency-Key -> every request id an enqueue with it was answered.
    key_answers: dict[str, set[str]]
    #: Columns per job (the cells of a job are `eval:<column>` for each).
    columns: Sequence[str]
    provider_calls: int
    #: Outbox file -> rows left in it.
    outbox_rows: dict[str, int]
    #: Fault kind -> how many were injected; plus connections cut by the proxies.
    faults: Counter[str] = field(default_factory=Counter)
    cut_connections: int = 0
    #: Faults of the run as logged lines, printed when a check fails.
    fault_log: list[str] = field(default_factory=list)


@dataclass
class Verdict:
    figures: dict[str, int]
    violations: list[str]

    @property
    def ok(self) -> bool:
        return not self.violations


def _cells_of(op: Mapping[str, Any]) -> list[tuple[str, str]]:
    if op.get("type") != "node.update":
        return []
    return [(str(op["node_id"]), key) for key in op.get("set", {}) if key.startswith("eval:")]


def check(history: History) -> Verdict:
    bad: list[str] = []
    writer_logs = {doc: history.logs.get(doc, []) for doc in DOCS}

    # -- ops: once each, none lost, in each writer's order ---------------------------------------
    logged = [op_id for doc in DOCS for _, op_id, _ in writer_logs[doc]]
    counts = Counter(logged)
    duplicates = sorted(op_id for op_id, n in counts.items() if op_id is not None and n > 1)
    if duplicates:
        bad.append(f"{len(duplicates)} ops applied more than once: {duplicates[:5]}")
    in_log = {op_id for op_id in counts if parse_op_id(op_id) is not None}
    acked = set().union(*history.acked.values()) if history.acked else set()
    lost = sorted(acked - in_log)
    if lost:
        bad.append(f"{len(lost)} acknowledged ops not in the log: {lost[:5]}")
    highest: dict[int, int] = {}
    for op_id in [*in_log, *acked]:
        if (key := parse_op_id(op_id)) is not None:
            highest[key[0]] = max(highest.get(key[0], -1), key[1])
    intended = {op_for(w, k)[1]["op_id"] for w, top in highest.items() for k in range(top + 1)}
    missing = sorted(intended - in_log)
    if missing:
        bad.append(f"{len(missing)} intended ops not in the log: {missing[:5]}")
    for doc, entries in writer_logs.items():
        by_writer: dict[int, list[int]] = {}
        for _, op_id, _ in entries:
            if (key := parse_op_id(op_id)) is not None:
                by_writer.setdefault(key[0], []).append(key[1])
        for w, ks in by_writer.items():
            if ks != sorted(ks):
                bad.append(f"writer {w}'s ops to {doc} applied out of order")
        _check_state(doc, entries, history.states.get(doc), bad)

    # -- clocks, subscribers --------------------------------------------------------------------
    for doc, entries in history.logs.items():
        clocks = [clock for clock, _, _ in entries]
        if clocks != list(range(1, len(clocks) + 1)):
            bad.append(f"{doc}: clocks are not 1..{len(clocks)}")
    diverged = 0
    for (who, doc), seen in history.seen.items():
        expected = [(clock, op_id) for clock, op_id, _ in history.logs.get(doc, [])]
        if seen != expected:
            diverged += 1
            bad.append(
                f"subscriber {who} of {doc} diverged from the log: {_first_diff(seen, expected)}"
            )

    # -- requests, cells, the provider ----------------------------------------------------------
    statuses = Counter(r.status for r in history.requests)
    unfinished = [r.request_id for r in history.requests if r.status not in _ENDED]
    if unfinished:
        bad.append(f"{len(unfinished)} requests did not end: {unfinished[:5]}")
    forked = sorted(key for key, ids in history.key_answers.items() if len(ids) != 1)
    if forked:
        bad.append(f"Idempotency-Keys answered with other request ids: {forked[:5]}")
    computed = Counter((r.job_id, cell) for r in history.requests for cell in r.computed)
    twice = sorted(cell for cell, n in computed.items() if n > 1)
    if twice:
        bad.append(f"cells computed by two requests: {twice[:5]}")
    written = Counter(
        cell for _, _, op in history.logs.get(history.jobs_doc, []) for cell in _cells_of(op)
    )
    rewritten = sorted(cell for cell, n in written.items() if n > 1)
    if rewritten:
        bad.append(f"cells written twice: {rewritten[:5]}")
    done_jobs = {r.job_id for r in history.requests if r.status == "done"}
    cells = {(job, f"eval:{c}") for job in done_jobs for c in history.columns}
    unwritten = sorted(cells - set(written))
    if unwritten:
        bad.append(f"cells of done jobs never written: {unwritten[:5]}")
    worker_kills = history.faults["kill_worker"]
    if history.provider_calls > len(written) + worker_kills:
        bad.append(
            f"provider paid {history.provider_calls} times for {len(written)} cells"
            f" and {worker_kills} killed workers"
        )

    # -- outboxes --------------------------------------------------------------------------------
    left = {name: n for name, n in history.outbox_rows.items() if n}
    if left:
        bad.append(f"outboxes not empty: {left}")

    figures = {
        "intended": len(intended),
        "acknowledged": len(acked),
        "applied": len(in_log),
        "duplicates": len(duplicates),
        "lost": len(lost),
        "missing": len(missing),
        "subscribers": len(history.seen),
        "subscribers_diverged": diverged,
        "requests": len(history.requests),
        "done": statuses["done"],
        "cancelled": statuses["cancelled"],
        "poison": statuses["poison"],
        "cells": len(written),
        "provider_calls": history.provider_calls,
        "worker_kills": worker_kills,
        "kills": sum(n for kind, n in history.faults.items() if kind in KILLS),
        "cut_connections": history.cut_connections,
        "outboxes": len(history.outbox_rows),
        "outboxes_left": len(left),
    }
    return Verdict(figures, bad)


_ENDED = frozenset({"done", "cancelled", "poison"})


def _check_state(
    doc: str, entries: Iterable[Entry], state: dict[str, Any] | None, bad: list[str]
) -> None:
    """The reducer applied each logged op once: the counter is the number of increments logged,
    each leaf is where the last logged move put it."""
    if state is None:
        return
    increments, last_move = 0, {}
    for _, op_id, op in entries:
        if parse_op_id(op_id) is None:
            continue
        if op.get("type") == "node.increment":
            increments += 1
        elif op.get("type") == "node.move":
            last_move[op["node_id"]] = op["parent_id"]
    nodes = state.get("nodes", {})
    counter = nodes.get("counter", {}).get("fields", {}).get("n")
    if counter != increments:
        bad.append(f"{doc}: counter is {counter}, {increments} increments were logged")
    for leaf, parent in last_move.items():
        if nodes.get(leaf, {}).get("parent") != parent:
            bad.append(f"{doc}: {leaf} is not under {parent}, where its last move put it")


def _first_diff(seen: Sequence[tuple[int, str | None]], expected: Sequence[Any]) -> str:
    for i, (a, b) in enumerate(zip(seen, expected, strict=False)):
        if a != b:
            return f"at #{i}: saw {a}, the log has {b}"
    return f"saw {len(seen)} entries, the log has {len(expected)}"
