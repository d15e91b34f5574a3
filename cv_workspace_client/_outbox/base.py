"""The client's outbox: ops written down before their first send, deleted once answered.

Two implementations behind one small seam: `SQLiteOutbox` (`_outbox/sqlite.py`: a file, survives
crashes and restarts; the default whenever the app passes a path) and `MemoryOutbox`
(`outbox=None`: retries and reconnects are still safe, a process restart loses what was pending).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from cv_workspace_client._core.effects import BacklogRange, LaneBacklog, OutboxRow

__all__ = ["MemoryOutbox", "Outbox", "OutboxSync", "OutboxWrite", "take_page"]

#: When an op's outbox fsync happens: while its first send is under way, or before it.
OutboxSync = Literal["alongside", "before_send"]


@dataclass(slots=True)
class OutboxWrite:
    """One unit of work for the outbox: rows to insert, seqs to delete, seqs whose attempt count
    grows, lanes' on-disk rows to delete (`discard_pending`). `done(error)` runs once the write
    is applied (error None) or failed; it may run before `write` returns."""

    inserts: list[OutboxRow] = field(default_factory=list)
    deletes: list[int] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)
    ranges: list[BacklogRange] = field(default_factory=list)
    #: Rows whose op text gets a new lane stamp (same outbox seq), and lanes' last minted seq
    #: set as given, `(workspace_id, sub_doc, seq)` (docs/client.md#exactly-once).
    restamps: list[OutboxRow] = field(default_factory=list)
    lane_seqs: list[tuple[str, str, int]] = field(default_factory=list)
    done: Callable[[BaseException | None], None] | None = None

    def __bool__(self) -> bool:
        return bool(
            self.inserts
            or self.deletes
            or self.attempts
            or self.ranges
            or self.restamps
            or self.lane_seqs
        )


class Outbox(abc.ABC):
    """Where pending ops live. `rows` is what a previous client left, in seq order (or, when
    opened with a page size, the first page of each lane); `backlog` counts them per lane."""

    durable: bool = False

    def __init__(self) -> None:
        self.rows: list[OutboxRow] = []
        self.backlog: list[LaneBacklog] = []
        #: The client id this outbox's ops were minted under, and each lane's last minted seq
        #: (docs/client.md#exactly-once): kept with the rows, so a restarted client goes on
        #: with the same id and sequence. None: the outbox keeps no id (memory), mint a new one.
        self.client_id: str | None = None
        self.lane_seqs: dict[tuple[str, str], int] = {}

    @abc.abstractmethod
    def write(self, job: OutboxWrite) -> None:
        """Apply `job` (in the order writes are made); never blocks on a disk flush."""

    def synced(self, seq: int) -> bool:
        """True once the insert of row `seq` survives a power loss (if this outbox can)."""
        return True

    async def sync(self, seq: int | None = None) -> None:
        """Return once the inserts up to row `seq` (default: all so far) survive a power loss."""
        return None

    async def flush(self) -> None:
        """Return once every write made so far (deletes too) survives a power loss."""
        return None

    @abc.abstractmethod
    async def close(self, *, abort: bool = False) -> None:
        """Release the outbox (with `abort`, without waiting for anything, as a crash would)."""

    @abc.abstractmethod
    async def pending(self) -> list[OutboxRow]:
        """The rows currently stored, in seq order (for diagnostics and tests)."""

    @abc.abstractmethod
    async def read_lane(
        self, workspace_id: str, sub_doc: str, after_seq: int, up_to_seq: int, limit: int
    ) -> list[OutboxRow]:
        """The lane's rows with `after_seq < seq <= up_to_seq` in seq order: the first `limit`,
        and the rest of the last one's atomic group (a group never straddles two pages)."""


class MemoryOutbox(Outbox):
    """`outbox=None`: the same contract, in a dict. Writes are applied immediately."""

    def __init__(self) -> None:
        super().__init__()
        self._rows: dict[int, OutboxRow] = {}

    def write(self, job: OutboxWrite) -> None:
        for row in job.inserts:
            self._rows[row.seq] = row
        for row in job.restamps:
            if row.seq in self._rows:
                self._rows[row.seq] = row
        for seq in job.attempts:
            stored = self._rows.get(seq)
            if stored is not None:
                self._rows[seq] = _with_attempt(stored)
        for seq in job.deletes:
            self._rows.pop(seq, None)
        for lane in job.ranges:
            for seq, row in list(self._rows.items()):
                if _in_range(row, lane):
                    del self._rows[seq]
        if job.done is not None:
            job.done(None)

    async def close(self, *, abort: bool = False) -> None:
        return None

    async def pending(self) -> list[OutboxRow]:
        return [self._rows[seq] for seq in sorted(self._rows)]

    async def read_lane(
        self, workspace_id: str, sub_doc: str, after_seq: int, up_to_seq: int, limit: int
    ) -> list[OutboxRow]:
        rows = (
            self._rows[seq]
            for seq in sorted(self._rows)
            if after_seq < seq <= up_to_seq
            and (self._rows[seq].workspace_id, self._rows[seq].sub_doc) == (workspace_id, sub_doc)
        )
        return take_page(rows, limit)


def _in_range(row: OutboxRow, lane: BacklogRange) -> bool:
    same_lane = row.workspace_id == lane.workspace_id and row.sub_doc == lane.sub_doc
    return same_lane and lane.after_seq < row.seq <= lane.up_to_seq


def _with_attempt(row: OutboxRow) -> OutboxRow:
    return OutboxRow(
        row.seq,
        row.workspace_id,
        row.sub_doc,
        row.op_id,
        row.op_json,
        row.created_at,
        row.attempts + 1,
        row.atomic_group,
        row.lane_seq,
    )


def take_page(rows: Iterator[OutboxRow], limit: int) -> list[OutboxRow]:
    """The first `limit` of `rows` (in seq order), and the rest of the last one's atomic group:
    an atomic call's ops travel in one request, so they must be loaded together."""
    page: list[OutboxRow] = []
    for row in rows:
        if len(page) >= limit and (
            row.atomic_group is None or row.atomic_group != page[-1].atomic_group
        ):
            break
        page.append(row)
    return page
