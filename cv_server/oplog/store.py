"""The op-log storage seam: domain verbs every backend implements (SQLite, PostgreSQL).

Every backend passes the same contract suite (`tests/contract/oplog_contract.py`). The values
the verbs take and answer live in the pure `values.py` (re-exported here): the commit pipeline
imports them from there. Neither imports asyncio: the commit pipeline is loaded without it
(`test_the_commit_pipeline_imports_no_io_module`), and this package's `__init__` loads this seam.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from cv_mutations import SubDocState
from cv_server.oplog.values import (
    Committed,
    Compaction,
    Forgotten,
    IncomingOp,
    LogEntry,
    OpLogCorrupted,
    OpLogStats,
    Outcome,
    Rejected,
    SubDocHead,
)

if TYPE_CHECKING:  # the seam names the future's type; it never makes one (no asyncio here)
    import asyncio

    from cv_server.queue.model import EnqueueAsk, Enqueued

__all__ = [
    "AppendEnqueued",
    "Committed",
    "Compaction",
    "Forgotten",
    "IncomingOp",
    "LogEntry",
    "OpLogCorrupted",
    "OpLogStats",
    "OpLogStore",
    "Outcome",
    "Rejected",
    "SubDocHead",
]


class AppendEnqueued(NamedTuple):
    """What `OpLogStore.append_enqueuing` answers: `append`'s outcomes and newly committed
    entries, and one queue answer per item asked (`enqueued`), or None when the batch newly
    applied no op and so enqueued nothing (a retry of a batch that committed, a rejected or
    conflicting batch)."""

    outcomes: list[Outcome]
    entries: list[LogEntry]
    enqueued: list[Enqueued] | None


class OpLogStore(abc.ABC):
    """The op-log of every sub-doc of every workspace.

    Rules every implementation keeps (docs/concepts.md):
    - dedupe on `(workspace_id, sub_doc, op_id)`: same fingerprint → the stored outcome with
      `duplicate=True`; different fingerprint → `Rejected(code="op_id_reuse")`, nothing applied;
    - clocks per sub-doc start at 0 and grow by 1 per committed op, with no gap;
    - ops of one `append` commit in their order; a rejected op does not stop the others unless
      `atomic=True`, in which case nothing of the batch is applied: the failing op gets its
      rejection (recorded), the others `atomic_aborted` (not recorded);
    - `if_clock` (compare-and-set): decided in the batch's transaction against the head it holds
      (the writer on SQLite, the head row lock on PostgreSQL), after dedupe: a head other than
      `if_clock` applies nothing and answers each op not decided before `version_conflict`
      carrying the head (docs/ops.md#conflicts);
    - `append` returns only after the batch is durable; only then may anyone publish it;
    - `append_enqueuing` (a store bound to the queue of its database) commits the requests in
      the same transaction as the ops, only if the batch newly applied an op, each stamped with
      the clock of the batch's last applied op (docs/queue.md, "Start work with the change that
      needs it"); a refused item (`RequestIdConflict`) or a failed write commits neither.
    """

    #: Ops between two state snapshots (`pipeline.snapshot_due`), and sub-doc states kept in
    #: memory; set by `_settings` on both backends (tests/contract/oplog_contract.py).
    snapshot_every: int
    cache_limit: int
    #: The dedupe window in seconds (`oplog_retention_seconds`; 0: op_id records are kept
    #: forever) and the clock skew allowed to `minted_at` (docs/ops.md#exactly-once).
    retention_seconds: float = 0.0
    skew_seconds: float = 0.0

    def _settings(
        self,
        *,
        snapshot_every: int,
        cache_limit: int,
        retention_seconds: float = 0.0,
        skew_seconds: float = 0.0,
    ) -> None:
        """Check and keep the settings every backend shares. Raises `ValueError` if
        `snapshot_every` or `cache_limit` is below 1, or a duration is negative."""
        if snapshot_every < 1:
            raise ValueError("snapshot_every must be at least 1")
        if cache_limit < 1:
            raise ValueError("cache_limit must be at least 1")
        if retention_seconds < 0 or skew_seconds < 0:
            raise ValueError("retention_seconds and skew_seconds must be >= 0")
        self.snapshot_every = snapshot_every
        self.cache_limit = cache_limit
        self.retention_seconds = retention_seconds
        self.skew_seconds = skew_seconds

    def latest_minted_at(self, now: float) -> int:
        """The latest `minted_at` (unix ms) an op can honestly carry at `now` (seconds): now plus
        the allowed skew. A lane op dated later cannot prove its age (docs/ops.md#exactly-once)."""
        return int((now + self.skew_seconds) * 1000)

    def expired_before(self, now: float) -> int | None:
        """The oldest `minted_at` (unix ms) inside the dedupe window at `now` (seconds): an op
        without a lane minted before it, whose op_id record is gone, is `op_expired`. None when
        records are kept forever. The window is shortened by the allowed skew, so a client clock
        ahead by up to it never passes a compacted op off as young."""
        if not self.retention_seconds:
            return None
        return int((now - self.retention_seconds + self.skew_seconds) * 1000)

    async def append(
        self,
        workspace_id: str,
        sub_doc: str,
        ops: Sequence[IncomingOp],
        *,
        atomic: bool = False,
        if_clock: int | None = None,
    ) -> tuple[list[Outcome], list[LogEntry]]:
        """Dedupe, apply and commit `ops`; return one outcome per op (in order) and the log
        entries this call newly committed (what must be broadcast). With `if_clock`, only if
        the sub-doc's head is still that clock (else `version_conflict`, nothing applied)."""
        # A caller cancelled here does not cancel the commit: its op may still be applied, and a
        # retry under the same op_id then gets `duplicate: true` (docs/concepts.md).
        return await self.append_nowait(
            workspace_id, sub_doc, ops, atomic=atomic, if_clock=if_clock
        )

    async def append_enqueuing(
        self,
        workspace_id: str,
        sub_doc: str,
        ops: Sequence[IncomingOp],
        enqueue: Sequence[EnqueueAsk],
        *,
        atomic: bool = False,
        if_clock: int | None = None,
    ) -> AppendEnqueued:
        """`append`, and in the same transaction, if the batch newly applied at least one op,
        `QueueStore.enqueue_many(enqueue)` with each request's `caused_by_clock` set to the
        clock of the batch's last applied op. The queue's announcements are made after the
        commit (`QueueStore.announce_committed`), even if the caller was cancelled meanwhile.

        Raises:
            RequestIdConflict: an item names a request of another workspace (nothing of the
                batch is committed: neither ops nor requests).
            NotImplementedError: this store is not bound to a queue.
        """
        raise NotImplementedError(f"{type(self).__name__} is not bound to a queue store")

    #: True when appends to one sub-doc commit in the order `append_nowait` was called (SQLite's
    #: one writer; PostgreSQL's lane per sub-doc): a caller may then submit the next append of a
    #: sub-doc without awaiting the previous one.
    appends_in_order: bool = False

    @abc.abstractmethod
    def append_nowait(
        self,
        workspace_id: str,
        sub_doc: str,
        ops: Sequence[IncomingOp],
        *,
        atomic: bool = False,
        if_clock: int | None = None,
    ) -> asyncio.Future[tuple[list[Outcome], list[LogEntry]]]:
        """`append` as the store's own future, queued now (an empty batch is answered at once).
        Commit order across calls is only promised when `appends_in_order`."""

    def observe_commits(self, observer: Callable[[float, int], None] | None) -> None:
        """Call `observer(seconds, ops)` after each group commit this process makes: its
        duration and the ops it held (for `cv_commit_seconds` / `cv_commit_batch_ops`). It may
        run on another thread (SQLite's writer): quick and thread-safe. Default: not observed."""
        del observer

    @abc.abstractmethod
    async def read_since(
        self, workspace_id: str, sub_doc: str, since: int, limit: int
    ) -> tuple[int, list[LogEntry]]:
        """The head clock and at most `limit` committed entries with clock > `since`, in order."""

    @abc.abstractmethod
    async def get_state(self, workspace_id: str, sub_doc: str) -> tuple[int, SubDocState]:
        """The head clock and a private copy of the state at that clock."""

    @abc.abstractmethod
    async def head(self, workspace_id: str, sub_doc: str) -> int:
        """The clock of the last committed op (0 for a sub-doc never written)."""

    @abc.abstractmethod
    async def list_sub_docs(
        self, workspace_id: str, *, after: str | None = None, limit: int
    ) -> list[SubDocHead]:
        """The workspace's sub-docs with at least one committed op, by name, each at its head.

        By name in the backend's order of names (byte order on SQLite, the database's collation
        on PostgreSQL): a listing paged with `after` is complete in either.

        At most `limit` of them, those named after `after` (the last name of the previous page;
        None: from the first). A sub-doc only ever rejected ops is not listed: its clock is 0,
        as for one never written. Raises `ValueError` if `limit` is negative.
        """

    # -- storage over time (docs/operating.md, "Storage over time") ----------------------------

    @abc.abstractmethod
    async def horizon(self, workspace_id: str, sub_doc: str) -> int:
        """The lowest clock still in the sub-doc's log; `head + 1` when it holds no op (1 for a
        sub-doc never written).

        The log of a sub-doc is always the contiguous range `[horizon, head]`: compaction only
        ever deletes a prefix of it, and never the op at or above the latest snapshot's clock,
        so the op at the head is always kept. A read from `since` is served by the log when
        `since >= horizon - 1`; below that, its ops are gone and the reader needs the state
        (`get_state`) instead.
        """

    @abc.abstractmethod
    async def compact(
        self, older_than: float, *, limit: int, start: tuple[str, str] | None = None
    ) -> Compaction:
        """Delete one bounded batch of old ops, in one short transaction.

        Deletes at most `limit` op rows (and the op_id records of those ops) that committed
        before `older_than` (epoch seconds, the clock that stamped the rows) and lie below
        their sub-doc's latest snapshot, visiting sub-docs in key order from `start`
        (inclusive; None: the first). Only a prefix of each sub-doc's log is deleted, so the
        log stays gap-free (`horizon`). Call again with the answer's `resume` until it is None:
        that is one compaction pass. Safe to run from several processes at once (PostgreSQL):
        each row is deleted once and a sub-doc another compactor holds is skipped, not waited
        for. Raises `ValueError` if `limit` is below 1.
        """

    @abc.abstractmethod
    async def expire_rejections(self, older_than: float, *, limit: int) -> int:
        """Delete at most `limit` recorded rejections older than `older_than` (epoch seconds),
        in one short transaction; return how many. A retry of such an op_id is then decided
        afresh (docs/ops.md). Raises `ValueError` if `limit` is below 1."""

    @abc.abstractmethod
    async def stats(self) -> OpLogStats:
        """The log's size and its oldest op's commit time, for `/metrics`. May read the whole
        table on SQLite: call it once per compaction pass, not per scrape."""

    @abc.abstractmethod
    async def client_mark(self, workspace_id: str, sub_doc: str, client_id: str) -> int:
        """The highest seq decided in the lane `(workspace_id, sub_doc, client_id)`: 0 when the
        lane never had an op decided (docs/ops.md#exactly-once). Updated in the transaction of
        the append that decides it, so it never runs ahead of, or behind, the log."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Finish in-flight appends and release resources."""
