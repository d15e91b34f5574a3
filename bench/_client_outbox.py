"""The outbox on its own, no server, no sockets: what the SDK's promise costs per op.

- **machine**: `OutboxMachine` alone (submit → persisted → Send → batch_answered → Forget), one op
  at a time and in batches of 100: the pure bookkeeping.
- **SQLite outbox, burst**: N single-op inserts queued at once, then their N deletes (what a
  pipelining client hands the outbox thread): group commit, a fraction of an fsync per op.
- **SQLite outbox, one at a time**: insert, wait until durable, delete, wait: what a client that
  awaits every op pays (two commits, two fsyncs per op, unless they share one); and the same
  with each delete joined to the next insert (one commit per op), which is what the outbox could
  do since a delete needs no fsync of its own (a surviving row is replayed as a duplicate).
- **memory outbox, burst**: the same calls on `MemoryOutbox`.

CPU is the process's (all threads: the outbox writer thread included); wall time includes the
fsyncs.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass
from pathlib import Path

from cv_workspace_client._machine import OutboxMachine, OutboxRow, Send
from cv_workspace_client._outbox import MemoryOutbox, Outbox, OutboxWrite, SQLiteOutbox

__all__ = ["OutboxFigure", "measure_outbox"]


@dataclass(frozen=True, slots=True)
class OutboxFigure:
    label: str
    ops: int
    wall_us: float
    cpu_us: float
    note: str = ""


def _row(seq: int) -> OutboxRow:
    op = (
        f'{{"type":"node.increment","node_id":"root","field":"w0","by":1,'
        f'"meta":{{"t":{time.time()}}},"op_id":"bench{seq:016d}"}}'
    )
    return OutboxRow(seq, "bench", "doc", f"bench{seq:016d}", op, time.time())


def _machine_figure(ops: int, batch: int) -> OutboxFigure:
    counter = iter(range(1, 10**9))
    machine = OutboxMachine(
        now=time.time, new_op_id=lambda: f"bench{next(counter):016d}", backoff=lambda n: 0.0
    )
    op = {"type": "node.increment", "node_id": "root", "field": "w0", "by": 1, "meta": {"t": 1.0}}
    clock = 0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(ops // batch):
        rows = machine.submit("bench", "doc", [op] * batch)
        machine.decisions()
        machine.persisted(row.seq for row in rows)
        (send,) = (d for d in machine.decisions() if isinstance(d, Send))
        results = []
        for row in send.rows:
            clock += 1
            results.append({"op_id": row.op_id, "clock": clock, "duplicate": False})
        machine.batch_answered(send.batch_id, results)
        machine.decisions()
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    done = (ops // batch) * batch
    return OutboxFigure(
        f"machine alone, batches of {batch}", done, wall / done * 1e6, cpu / done * 1e6
    )


async def _burst(outbox: Outbox, ops: int, first_seq: int) -> tuple[float, float]:
    loop = asyncio.get_running_loop()
    remaining = ops * 2
    finished = loop.create_future()

    def done(error: BaseException | None) -> None:
        nonlocal remaining
        if error is not None and not finished.done():
            finished.set_exception(error)
        remaining -= 1
        if remaining == 0 and not finished.done():
            finished.set_result(None)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    for seq in range(first_seq, first_seq + ops):
        outbox.write(OutboxWrite(inserts=[_row(seq)], done=done))
    for seq in range(first_seq, first_seq + ops):
        outbox.write(OutboxWrite(deletes=[seq], done=done))
    await finished
    return time.perf_counter() - wall0, time.process_time() - cpu0


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(None)


async def _one_at_a_time(
    outbox: Outbox, ops: int, first_seq: int, *, joined: bool = False
) -> tuple[float, float]:
    """`joined`: each op's delete rides along with the next op's insert (one commit per op)."""
    loop = asyncio.get_running_loop()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for seq in range(first_seq, first_seq + ops):
        if joined:
            jobs = [OutboxWrite(inserts=[_row(seq)], deletes=[seq - 1])]
        else:
            jobs = [OutboxWrite(inserts=[_row(seq)]), OutboxWrite(deletes=[seq])]
        for job in jobs:
            landed: asyncio.Future[None] = loop.create_future()
            job.done = functools.partial(_settle, landed)
            outbox.write(job)
            await landed
    return time.perf_counter() - wall0, time.process_time() - cpu0


async def _sqlite_figures(workdir: Path, burst_ops: int, single_ops: int) -> list[OutboxFigure]:
    outbox = await SQLiteOutbox.open(workdir / "outbox-bench.db")
    try:
        await _burst(outbox, 200, 1)  # warm: file created, pages allocated
        groups0, writes0 = outbox.groups_committed, outbox.writes_committed
        wall, cpu = await _burst(outbox, burst_ops, 1_000)
        groups = outbox.groups_committed - groups0
        writes = outbox.writes_committed - writes0
        burst = OutboxFigure(
            "SQLite outbox, burst (insert + delete)",
            burst_ops,
            wall / burst_ops * 1e6,
            cpu / burst_ops * 1e6,
            f"{writes / max(groups, 1):.0f} writes per commit",
        )
        groups0 = outbox.groups_committed
        wall, cpu = await _one_at_a_time(outbox, single_ops, 10_000_000)
        commits = outbox.groups_committed - groups0
        single = OutboxFigure(
            "SQLite outbox, one at a time",
            single_ops,
            wall / single_ops * 1e6,
            cpu / single_ops * 1e6,
            f"{commits / single_ops:.1f} commits (fsyncs) per op",
        )
        groups0 = outbox.groups_committed
        wall, cpu = await _one_at_a_time(outbox, single_ops, 20_000_000, joined=True)
        commits = outbox.groups_committed - groups0
        joined = OutboxFigure(
            "SQLite outbox, one at a time, delete joined",
            single_ops,
            wall / single_ops * 1e6,
            cpu / single_ops * 1e6,
            f"{commits / single_ops:.1f} commits per op: each delete rides with the next insert",
        )
    finally:
        await outbox.close()
    return [burst, single, joined]


async def _memory_figure(ops: int) -> OutboxFigure:
    wall, cpu = await _burst(MemoryOutbox(), ops, 1)
    return OutboxFigure(
        "memory outbox, burst (insert + delete)", ops, wall / ops * 1e6, cpu / ops * 1e6
    )


def measure_outbox(workdir: Path, *, quick: bool) -> list[OutboxFigure]:
    """All the figures above; a few seconds (bounded op counts)."""
    burst_ops = 5_000 if quick else 20_000
    single_ops = 100 if quick else 300
    figures = [_machine_figure(burst_ops, 1), _machine_figure(burst_ops, 100)]
    figures += asyncio.run(_sqlite_figures(workdir, burst_ops, single_ops))
    figures.append(asyncio.run(_memory_figure(burst_ops)))
    return figures
