"""The outbox on its own, no server, no sockets: what the SDK's promise costs per op.

- **machine**: `OutboxMachine` alone (submit → persisted → Send → batch_answered → Forget), one op
  at a time and in batches of 100: the pure bookkeeping.
- **SQLite outbox, burst**: N ops submitted in one tick (one write of N inserts, as the client's
  pump makes it), then their N deletes, then the fsync: what a pipelining client pays.
- **SQLite outbox, one at a time**: insert, delete, insert, ... with the fsync on the syncer
  thread alongside (the default, `outbox_sync="alongside"`): what a client that awaits every op
  pays on its event loop; and the same with `outbox_sync="before_send"` (each insert waits for its
  fsync before it counts as written: the strict order).
- **memory outbox, burst**: the same calls on `MemoryOutbox`.

CPU is the process's (all threads: the syncer thread's fsyncs included); wall time includes the
fsyncs the figure waits for.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass
from pathlib import Path

from cv_workspace_client._core.machine import OutboxMachine, OutboxRow, Send
from cv_workspace_client._outbox.base import MemoryOutbox, Outbox, OutboxWrite
from cv_workspace_client._outbox.sqlite import SQLiteOutbox

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
    """N inserts in one write, N deletes in one write, then the fsync."""
    seqs = range(first_seq, first_seq + ops)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    outbox.write(OutboxWrite(inserts=[_row(seq) for seq in seqs]))
    outbox.write(OutboxWrite(deletes=list(seqs)))
    await outbox.sync()
    return time.perf_counter() - wall0, time.process_time() - cpu0


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(None)


async def _one_at_a_time(outbox: Outbox, ops: int, first_seq: int) -> tuple[float, float]:
    """Per op: write its insert and wait until it counts as written, then write its delete."""
    loop = asyncio.get_running_loop()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for seq in range(first_seq, first_seq + ops):
        landed: asyncio.Future[None] = loop.create_future()
        outbox.write(OutboxWrite(inserts=[_row(seq)], done=functools.partial(_settle, landed)))
        await landed
        outbox.write(OutboxWrite(deletes=[seq]))
    await outbox.sync()
    return time.perf_counter() - wall0, time.process_time() - cpu0


async def _sqlite_figures(workdir: Path, burst_ops: int, single_ops: int) -> list[OutboxFigure]:
    figures: list[OutboxFigure] = []
    outbox = await SQLiteOutbox.open(workdir / "outbox-bench.db")
    try:
        await _burst(outbox, 200, 1)  # warm: file created, pages allocated
        fsyncs0 = outbox.fsyncs
        wall, cpu = await _burst(outbox, burst_ops, 1_000)
        figures.append(
            OutboxFigure(
                "SQLite outbox, burst (insert + delete)",
                burst_ops,
                wall / burst_ops * 1e6,
                cpu / burst_ops * 1e6,
                f"2 commits and {outbox.fsyncs - fsyncs0} fsync(s) for {burst_ops:,} ops",
            )
        )
        commits0, fsyncs0 = outbox.groups_committed, outbox.fsyncs
        wall, cpu = await _one_at_a_time(outbox, single_ops, 10_000_000)
        figures.append(
            OutboxFigure(
                "SQLite outbox, one at a time (fsync alongside)",
                single_ops,
                wall / single_ops * 1e6,
                cpu / single_ops * 1e6,
                f"{(outbox.groups_committed - commits0) / single_ops:.1f} commits and"
                f" {(outbox.fsyncs - fsyncs0) / single_ops:.2f} fsyncs per op",
            )
        )
    finally:
        await outbox.close()
    strict = await SQLiteOutbox.open(workdir / "outbox-bench-strict.db", sync="before_send")
    try:
        await _one_at_a_time(strict, 20, 1)
        fsyncs0 = strict.fsyncs
        wall, cpu = await _one_at_a_time(strict, single_ops, 1_000)
        figures.append(
            OutboxFigure(
                "SQLite outbox, one at a time (fsync before send)",
                single_ops,
                wall / single_ops * 1e6,
                cpu / single_ops * 1e6,
                f"{(strict.fsyncs - fsyncs0) / single_ops:.2f} fsyncs per op, each waited for",
            )
        )
    finally:
        await strict.close()
    return figures


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
