"""One measured phase of `bench.client`: client processes against a running `cv-server`, their
results gathered and checked.

The parent starts the subscriber processes, waits until every subscription is live, starts the
writer processes, waits until every writer is connected and warm, then says `go` and times the
writing window. Afterwards it checks, per sub-doc, that the clocks the writers were acknowledged
are exactly the next ones (no op applied twice, none lost), that every subscriber saw exactly
those ops in that order (digest of (clock, op_id)), and that each writer's counter in the server's
state equals the ops it was acknowledged.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import secrets
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from bench._client_workers import (
    Control,
    SubscriberJob,
    SubscriberResult,
    WorkerFailed,
    WriterJob,
    WriterResult,
    worker_main,
)
from bench._digest import digest_of
from bench._procs import MachineLoad, ServerProcess, percentiles
from cv_mutations import new_op_id

__all__ = ["Phase", "run_phase", "warm_sub_docs"]

#: Client processes must be ready (connected, warm, subscriptions live) within this.
READY_TIMEOUT_S: Final = 120.0
#: Slack on top of the writers' time cap for their results to come back.
RESULT_SLACK_S: Final = 90.0


@dataclass(slots=True)
class Phase:
    """What one phase measured, and whether it was correct."""

    ops: int = 0
    duration_s: float = 0.0
    ops_per_s: float = 0.0
    ack_ms: dict[str, float] = field(default_factory=dict)
    broadcast_ms: dict[str, float] = field(default_factory=dict)
    deliveries: int = 0
    wall_s: float = 0.0
    server_cpu_main_s: float = 0.0
    server_cpu_other_s: float = 0.0
    client_cpu_main_s: float = 0.0
    client_cpu_other_s: float = 0.0
    machine_cores: float = 0.0
    cpu_stall: float | None = None
    #: os.getloadavg() when the writers were told to go.
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    checks: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    correct: bool = True


def _request(server: ServerProcess, method: str, path: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{server.url}{path}",
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {server.token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def warm_sub_docs(server: ServerProcess, workspace: str, sub_docs: Sequence[str]) -> dict[str, str]:
    """Commit one op (clock 1) on each sub-doc: subscribers prove they are live by seeing it.
    Returns sub_doc → its op_id."""
    warm: dict[str, str] = {}
    for sub_doc in sub_docs:
        op_id = new_op_id()
        op = {"type": "node.increment", "op_id": op_id, "node_id": "root", "field": "warm"}
        answer = _request(
            server, "POST", f"/v1/workspaces/{workspace}/docs/{sub_doc}/ops", {"ops": [op]}
        )
        if answer["results"][0].get("clock") != 1:
            raise RuntimeError(f"{sub_doc} is not fresh: warm op answered {answer}")
        warm[sub_doc] = op_id
    return warm


def run_phase(
    server: ServerProcess,
    writer_jobs: Sequence[WriterJob],
    subscriber_jobs: Sequence[SubscriberJob] = (),
    *,
    warm: dict[str, str] | None = None,
) -> Phase:
    """Run the jobs (each in its own spawned process) and check what they saw."""
    phase = Phase()
    warm = warm or {}
    ctx = multiprocessing.get_context("spawn")
    control = Control(go=ctx.Event(), ready=ctx.Queue(), results=ctx.Queue(), inbox=None)
    procs: list[Any] = []
    inboxes: list[Any] = []
    try:
        for sjob in subscriber_jobs:
            inbox = ctx.Queue()
            inboxes.append(inbox)
            procs.append(
                _spawn(ctx, sjob, Control(control.go, control.ready, control.results, inbox))
            )
        _wait_ready(control, len(subscriber_jobs), server, procs)
        for wjob in writer_jobs:
            procs.append(_spawn(ctx, wjob, control))
        _wait_ready(control, len(writer_jobs), server, procs)

        cap = max(job.time_cap_s for job in writer_jobs)
        cpu_before = server.cpu_seconds()
        load_before = MachineLoad.now()
        phase.load = os.getloadavg()
        began = time.perf_counter()
        control.go.set()
        writers: list[WriterResult] = _collect(control, len(writer_jobs), cap + RESULT_SLACK_S)
        phase.wall_s = time.perf_counter() - began
        cpu_after = server.cpu_seconds()
        phase.machine_cores, phase.cpu_stall = MachineLoad.now().since(load_before)
        phase.server_cpu_main_s = cpu_after[0] - cpu_before[0]
        phase.server_cpu_other_s = cpu_after[1] - cpu_before[1]

        finals, digests = _check_acks(phase, writers, warm)
        for inbox in inboxes:
            inbox.put(finals)
        subscribers: list[SubscriberResult] = _collect(
            control, len(subscriber_jobs), RESULT_SLACK_S
        )
        _summarise(phase, writers, subscribers)
        if subscriber_jobs:
            watched = sum(job.subscribers * len(job.sub_docs) for job in subscriber_jobs)
            _check_subscribers(phase, subscribers, finals, digests, watched)
        _check_state(phase, server, writer_jobs[0].workspace, writers)
    except (RuntimeError, TimeoutError, OSError) as exc:
        phase.correct = False
        phase.errors.append(f"{type(exc).__name__}: {exc}")
        for inbox in inboxes:
            inbox.put(None)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
    return phase


def _spawn(ctx: Any, job: WriterJob | SubscriberJob, control: Control) -> Any:
    proc = ctx.Process(target=worker_main, args=(job, control), name=job.name)
    proc.start()
    return proc


def _wait_ready(control: Control, count: int, server: ServerProcess, procs: list[Any]) -> None:
    ready = 0
    deadline = time.monotonic() + READY_TIMEOUT_S
    while ready < count:
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server died: {server.stderr_tail()}")
        if not control.results.empty():
            failed = control.results.get()
            raise RuntimeError(f"a client process failed while getting ready: {failed}")
        dead = [proc.name for proc in procs if proc.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"client processes died before getting ready: {dead}")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{count - ready} client processes never got ready")
        try:
            control.ready.get(timeout=min(1.0, remaining))
        except queue.Empty:
            continue
        ready += 1


def _collect(control: Control, count: int, timeout: float) -> list[Any]:
    results: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(results) < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{count - len(results)} client processes sent no result")
        try:
            result = control.results.get(timeout=remaining)
        except queue.Empty:
            continue
        if isinstance(result, WorkerFailed):
            raise RuntimeError(f"client process {result.name} failed:\n{result.error}")
        results.append(result)
    return results


def _check_acks(
    phase: Phase, writers: list[WriterResult], warm: dict[str, str]
) -> tuple[dict[str, int], dict[str, str]]:
    """Per sub-doc: the acknowledged clocks continue the warm op's without a gap or a repeat.
    Returns the final clock and the digest a subscriber must hold, per sub-doc."""
    by_doc: dict[str, list[tuple[int, str]]] = {doc: [(1, op_id)] for doc, op_id in warm.items()}
    for result in writers:
        for sub_doc, clock, op_id in result.acks:
            by_doc.setdefault(sub_doc, []).append((clock, op_id))
    finals: dict[str, int] = {}
    bad = []
    for sub_doc, entries in by_doc.items():
        entries.sort()
        clocks = [clock for clock, _ in entries]
        if clocks != list(range(1, len(clocks) + 1)):
            bad.append(sub_doc)
        finals[sub_doc] = clocks[-1] if clocks else 0
    duplicates = sum(w.duplicates for w in writers)
    phase.checks.append(
        f"acked clocks 1..n on {len(by_doc) - len(bad)}/{len(by_doc)} sub-docs,"
        f" {duplicates} duplicate answers"
    )
    if bad or duplicates:
        phase.correct = False
        phase.errors.append(f"acked clocks not consecutive on {bad[:5]}")
    return finals, {sub_doc: digest_of(entries) for sub_doc, entries in by_doc.items()}


def _summarise(
    phase: Phase, writers: list[WriterResult], subscribers: list[SubscriberResult]
) -> None:
    started = min(w.started for w in writers)
    ended = max(w.ended for w in writers)
    phase.duration_s = ended - started
    phase.ops = sum(w.ops for w in writers)
    phase.ops_per_s = phase.ops / phase.duration_s if phase.duration_s > 0 else 0.0
    phase.ack_ms = percentiles([ms for w in writers for ms in w.ack_ms])
    phase.broadcast_ms = percentiles([ms for s in subscribers for ms in s.broadcast_ms])
    phase.deliveries = sum(s.deliveries for s in subscribers)
    phase.client_cpu_main_s = sum(w.cpu_main_s for w in writers)
    phase.client_cpu_main_s += sum(s.cpu_main_s for s in subscribers)
    phase.client_cpu_other_s = sum(w.cpu_other_s for w in writers)
    phase.client_cpu_other_s += sum(s.cpu_other_s for s in subscribers)
    for w in writers:
        if w.errors:
            phase.correct = False
            phase.errors.append(f"{w.name}: {w.errors} failed ops: {w.error_samples}")


def _check_subscribers(
    phase: Phase,
    subscribers: list[SubscriberResult],
    finals: dict[str, int],
    digests: dict[str, str],
    expected_watches: int,
) -> None:
    seen = {key: value for s in subscribers for key, value in s.seen.items()}
    wrong = [
        key
        for key, (last, digest, count) in seen.items()
        if last != finals.get(key[1]) or digest != digests.get(key[1]) or count != last
    ]
    violations = sum(s.violations for s in subscribers)
    for s in subscribers:
        phase.errors.extend(f"{s.name}: {e}" for e in s.error_samples)
    phase.checks.append(
        f"exactly once, in order: {len(seen) - len(wrong)}/{expected_watches} subscriptions saw"
        f" every acked op once in clock order ({violations} duplicate/out-of-order deliveries)"
    )
    if wrong or violations or len(seen) != expected_watches:
        phase.correct = False


def _check_state(
    phase: Phase, server: ServerProcess, workspace: str, writers: list[WriterResult]
) -> None:
    """Each writer's counter in the server's state equals the ops it was acknowledged."""
    counters = [c for w in writers for c in w.counters]
    states: dict[str, dict[str, Any]] = {}
    bad = []
    for index, sub_doc, acked in counters:
        if sub_doc not in states:
            answer = _request(server, "GET", f"/v1/workspaces/{workspace}/docs/{sub_doc}")
            states[sub_doc] = answer["state"]["nodes"]["root"]["fields"]
        if states[sub_doc].get(f"w{index}", 0) != acked:
            bad.append((index, sub_doc, acked, states[sub_doc].get(f"w{index}")))
    phase.checks.append(
        f"server counters == acked ops for {len(counters) - len(bad)}/{len(counters)} writers"
    )
    if bad:
        phase.correct = False
        phase.errors.append(f"counters differ (writer, sub_doc, acked, server): {bad[:5]}")


def workspace_name() -> str:
    return f"bench-{secrets.token_hex(4)}"
