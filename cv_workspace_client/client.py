"""`WorkspaceClient`: the asyncio shell around the outbox machine (docs/client.md).

The shell owns the I/O and nothing else: the outbox file, one aiohttp session for HTTP, one
websocket per workspace in use, timers. Every decision — what to persist, what to send and when,
what to retry, when to give up — is `OutboxMachine`'s, and `OpPump` (`_io/pump.py`) carries the
decisions out. This module holds the client's lifetime and its public verbs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, NamedTuple

import aiohttp
import orjson

from cv_mutations import (
    Op,
    SubDocState,
    new_op_id,
    parse_op,
)
from cv_mutations import new_op_id as new_client_id
from cv_workspace_client._core.conflicts import ConflictRetryPolicy
from cv_workspace_client._core.machine import (
    BacklogRange,
    Discard,
    OutboxMachine,
    OutboxRow,
)
from cv_workspace_client._core.url import check_server_url
from cv_workspace_client._io.auth import RefreshPolicy, TokenProvider, TokenRefresher
from cv_workspace_client._io.conditional import Change, ConditionalWrites
from cv_workspace_client._io.http import HttpApi
from cv_workspace_client._io.pump import OpLike, OpPump
from cv_workspace_client._io.reads import Reads, check_ids
from cv_workspace_client._io.retry import backoff_for, reconnect_policy_for
from cv_workspace_client._io.socket import WorkspaceSocket
from cv_workspace_client._io.status import SyncSignals
from cv_workspace_client._outbox.base import MemoryOutbox, Outbox, OutboxWrite
from cv_workspace_client._outbox.discard import retrieve, settle_discard
from cv_workspace_client._outbox.sqlite import SQLiteOutbox
from cv_workspace_client._queue.requester import QueueMethods
from cv_workspace_client.config import ClientConfig
from cv_workspace_client.errors import (
    ClientClosedError,
    OpRejectedError,
    OutboxError,
    StillPendingError,
    WorkspaceError,
)
from cv_workspace_client.models import Commit, Committed, Snapshot, SyncStatus
from cv_workspace_client.queue_models import AppliedAndEnqueued, EnqueueItem
from cv_workspace_client.stream import Subscription

__all__ = ["WorkspaceClient"]

log = logging.getLogger(__name__)


class _Undiscarded(NamedTuple):
    """A discard the outbox could not make durable, to write again."""

    workspace_id: str
    deletes: list[int]
    ranges: list[BacklogRange]
    ops: int


class WorkspaceClient(QueueMethods):
    """The retry-safe client. Use as `async with WorkspaceClient(url, token=..., outbox=...)`.

    Ops (`apply_op`, `apply_ops`), reads (`get_state`, `read_ops`), live ops (`subscribe`), and
    the work queue's verbs (`enqueue`, `wait_request`, ...: `QueueMethods`, docs/queue.md).

    Args:
        url: the server's base URL (`http://host:port`).
        token: the bearer token (`cv-server token --workspace W`).
        token_provider: an async callable returning a fresh token. Asked at start when `token`
            is None, and whenever the server refuses the token in use (expired, revoked): the
            refused request goes again with the new one, a refused websocket reconnects, and
            the ops parked on the refusal are resent under their op_ids. Tokens it gives that
            are refused in turn are retried with the client's backoff, `retry_attempts` times
            in a row at most; then the refusal stands (`sync_status.refused`) until
            `set_token()`, `retry_pending()` or `wait_synced()`.
        outbox: a SQLite file path for the durable outbox, or None for an in-memory one (safe
            across retries and reconnects, not across a process restart). One client per file.
        config: retry, batching and transport settings (`ClientConfig`).
        now: wall clock for `created_at` (injectable for tests).
        new_op_id: the op_id minter (injectable for tests).

    Guarantees: an op gets its op_id before it is first written; it is in the outbox file (safe
    from the process dying) before it is first sent, and on disk (safe from a power loss) before
    the client says it waits there (`StillPendingError`, `close`); it keeps its op_id for every
    retry, reconnect and restart, and leaves the outbox only once the server answered it.
    Ops to one sub-doc are applied in the order they were submitted.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        token_provider: TokenProvider | None = None,
        outbox: str | os.PathLike[str] | None = None,
        config: ClientConfig | None = None,
        now: Callable[[], float] = time.time,
        new_op_id: Callable[[], str] = new_op_id,
    ) -> None:
        self.url = check_server_url(url)
        self.token = token
        self.outbox_path = outbox
        self.config = config or ClientConfig()
        self.backoff = backoff_for(self.config)
        self.reconnect = reconnect_policy_for(self.config)
        self._now = now
        self._mint = new_op_id
        self._machine = OutboxMachine(
            now=now,
            new_op_id=new_op_id,
            backoff=self.backoff,
            max_attempts=self.config.retry_attempts,
            max_batch_ops=self.config.max_batch_ops,
            max_batch_bytes=self.config.max_batch_bytes,
            retry_after_cap=self.config.retry_cap_seconds,
        )
        self._state = "new"
        self._outbox: Outbox | None = None
        self._session: aiohttp.ClientSession | None = None
        self._http: HttpApi | None = None
        #: The callers' futures by outbox seq: resolved by the pump, failed by `close()`.
        self._futures: dict[int, tuple[asyncio.Future[Commit], str]] = {}
        #: Discards the outbox could not make durable (workspace, deletes, on-disk ranges, op
        #: count): the app asked for them and was told `OutboxError`; the workspace's next
        #: `discard_pending`, or `close()`, writes them again.
        self._undiscarded: list[_Undiscarded] = []
        self._sockets: dict[str, WorkspaceSocket] = {}
        #: Weak: a subscription the app dropped is released (see `WorkspaceSocket._subs`).
        self._subscriptions: weakref.WeakSet[Subscription] = weakref.WeakSet()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._signals = SyncSignals(self._machine, lambda: self.sync_status)
        #: The parts: the pump moves ops (outbox machine → outbox, sockets, HTTP); the reads.
        self._ops = OpPump(
            _PumpPorts(self),
            config=self.config,
            machine=self._machine,
            signals=self._signals,
            futures=self._futures,
            mint=new_op_id,
        )
        self._reads = Reads(self.config, self._api)
        self._conditional = ConditionalWrites(self.config, self._api, self._reads, self._mint)
        #: Every refusal of the token goes through it (HTTP, queue calls, websockets): the app's
        #: provider, if any, is asked once for all of them (`_io/auth.py`).
        self.token_refresher: TokenRefresher = TokenRefresher(
            token_provider,
            current=lambda: self.token,
            adopt=self._adopt_token,
            policy=RefreshPolicy(self.config.retry_attempts, self.backoff),
            sleep=self.config.sleep,
            timeout=self.config.request_timeout_seconds,
        )

    # -- lifetime ----------------------------------------------------------------------------------

    async def __aenter__(self) -> WorkspaceClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Open the outbox and the HTTP session, then replay what a previous client left pending
        (first, in its original order). Idempotent."""
        if self._state == "open":
            return
        if self._state != "new":
            raise RuntimeError("a closed WorkspaceClient cannot be restarted; make a new one")
        if self.token is None and self.token_refresher.provider is not None:
            # Asked before anything is opened: a start cancelled while the provider was out
            # left the outbox open and locked (a new client on it failed with `outbox_locked`)
            # and the HTTP session unclosed. A provider that fails (an app started offline, its
            # auth server unreachable) leaves no token: ops still queue, and the first refusal
            # asks the provider again. Its answer is checked as a refresh's is (`ask`).
            self.token = await self.token_refresher.ask()
        if self.outbox_path is not None:
            # A large backlog is read a page per sub-doc at a time, the machine's page: two
            # batches (`2 * max_batch_ops`), so memory stays bounded by sub-docs x pages.
            self._outbox = await SQLiteOutbox.open(
                self.outbox_path,
                sync=self.config.outbox_sync,
                page_rows=self._machine.restore_page,
            )
        else:
            self._outbox = MemoryOutbox()
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_seconds)
        )
        self._http = HttpApi(self._session, self.url, self.token, refresher=self.token_refresher)
        self._state = "open"
        # A client id is no op_id: it never comes from the app's injected op_id minter
        # (tests/client/test_live_doc.py, test_ops_get_the_clients_op_ids_...).
        self._machine.use_lanes(self._outbox.client_id or new_client_id(), self._outbox.lane_seqs)
        self._machine.restore(self._outbox.rows, self._outbox.backlog)
        if self.config.ops_over_websocket:
            for workspace_id in self._machine.workspaces():
                self._socket(workspace_id)
        self._ops.pump()

    async def close(self) -> None:
        """Stop: pending ops stay in the outbox (a file outbox replays them on the next start);
        their awaiters get `StillPendingError` (file) or `ClientClosedError` (memory), or
        `OutboxError("outbox_sync_failed")` if the file could not be made durable."""
        await self._shutdown(abort=False)

    async def abort(self) -> None:
        """Close as a crash would: drop queued outbox writes, no goodbyes. For replay tests
        (`cv_workspace_client.testing.restart_client`)."""
        await self._shutdown(abort=True)

    async def _shutdown(self, *, abort: bool) -> None:
        if self._state != "open":
            self._state = "closed"
            self._signals.close()
            return
        self._state = "closing"
        self.token_refresher.close()
        for sub in list(self._subscriptions):
            sub.end()
        for sock in self._sockets.values():
            await sock.close(abort=abort)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._ops.cancel_scheduled()
        outbox = self._outbox
        assert outbox is not None
        if not outbox.durable and self._machine.pending_count:
            dropped = self._machine.pending_count
            log.warning(
                "close() drops %d op(s) the server never answered: outbox=None keeps pending ops"
                " in memory only (give the client a file outbox to keep them across a close)",
                dropped,
            )
        if not abort:
            self._ops.pump()  # hand the last decided writes to the outbox
            for _, deletes, ranges, _ in self._undiscarded:
                # The app gave these up and was told the discard failed: one more try, made
                # durable by the close's final fsync, or the next client would apply them.
                outbox.write(OutboxWrite(deletes=deletes, ranges=ranges))
            self._undiscarded = []
        await outbox.close(abort=abort)
        self._state = "closed"
        durable = outbox.durable and not abort
        for seq, (future, op_id) in self._futures.items():
            if future.done():
                continue
            error: WorkspaceError
            if not durable:
                error = ClientClosedError(op_id)
            elif outbox.synced(seq):
                error = StillPendingError(op_id)
            else:
                # The close's final fsync failed (the outbox's directory removed, a disk error):
                # "it stays in the outbox and will be replayed" would be false, and the app would
                # never re-submit an op nothing will replay.
                error = OutboxError(
                    "outbox_sync_failed", f"op {op_id} could not be made durable in the outbox"
                )
            future.set_exception(error)
        self._futures.clear()
        self._signals.close()
        if self._session is not None:
            await self._session.close()

    # -- ops ---------------------------------------------------------------------------------------

    async def apply_op(
        self, workspace_id: str, sub_doc: str, op: OpLike, *, if_clock: int | None = None
    ) -> Commit:
        """Apply one op; return its `Commit` once the server committed it (or had already).

        With `if_clock` (compare-and-set, docs/ops.md#conflicts) it commits only if the sub-doc
        is still at that clock, else raises `VersionConflictError` (`.clock`: where it is now);
        such an op is sent at once, not kept in the outbox.

        Raises `OpRejectedError` (the server rejected it), `InvalidRequestError` / `AuthError` /
        `ForbiddenError` (final 4xx, not retried), or `StillPendingError` (no answer after the
        last attempt: the op stays in the outbox under `.op_id` and is replayed later).
        Cancelling the call does not unsend the op (it is applied once); to submit the same
        intent again after a cancel, give the op its own `op_id` (`cv_mutations.new_op_id()`)
        and pass the same op again: the server answers `duplicate: true`.
        """
        if if_clock is not None:
            (outcome,) = await self._conditional.apply(
                workspace_id, sub_doc, [op], atomic=False, if_clock=if_clock
            )
            if isinstance(outcome, OpRejectedError):
                raise outcome
            return outcome
        (future,) = self._ops.submit(workspace_id, sub_doc, [op], atomic=False)
        return await future

    async def apply_ops(
        self,
        workspace_id: str,
        sub_doc: str,
        ops: Sequence[OpLike],
        *,
        atomic: bool = False,
        if_clock: int | None = None,
    ) -> list[Commit | OpRejectedError]:
        """Apply ops in order; one outcome each: a `Commit` or the op's `OpRejectedError`.

        With `atomic=True` they travel as one request and all commit or none does (the others
        answer `atomic_aborted`). Whole-request failures (final 4xx, `StillPendingError`) raise.
        With `if_clock` they travel as one request, sent at once (not kept in the outbox), and
        commit only if the sub-doc is still at that clock: else `VersionConflictError` is
        raised and nothing was applied (docs/ops.md#conflicts).
        """
        if if_clock is not None:
            return await self._conditional.apply(
                workspace_id, sub_doc, ops, atomic=atomic, if_clock=if_clock
            )
        futures = self._ops.submit(workspace_id, sub_doc, ops, atomic=atomic)
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        results: list[Commit | OpRejectedError] = []
        for outcome in outcomes:
            if isinstance(outcome, Commit | OpRejectedError):
                results.append(outcome)
            else:
                raise outcome
        return results

    async def apply_ops_and_enqueue(
        self,
        workspace_id: str,
        sub_doc: str,
        ops: Sequence[OpLike],
        enqueue: Sequence[EnqueueItem],
        *,
        atomic: bool = False,
        if_clock: int | None = None,
    ) -> AppliedAndEnqueued:
        """Apply ops and queue the stage runs they need in one transaction: the requests are
        enqueued only if the batch applies an op, each naming the clock of its commit
        (`QueuedRequest.caused_by_clock`; docs/queue.md, "Start work with the change that needs
        it"). Needs a token with the `enqueue` scope besides `write`.

        Call it when a change must not be left without its work (a crash between an apply and
        an enqueue would). It is sent at once over HTTP, not kept in the outbox: a lost answer
        is retried under the same op_ids, which the server answers with the same requests and
        enqueues nothing twice. Returns one outcome per op and one answer per item (None: not
        enqueued, the batch applied nothing). Raises as `apply_ops(if_clock=)` does
        (`VersionConflictError` with `if_clock`, final 4xx errors such as `ForbiddenError`, or
        the last retryable error: then send the same ops and items again to learn their fate).
        """
        self._check_open()
        return await self._conditional.apply_and_enqueue(
            workspace_id, sub_doc, ops, enqueue, atomic=atomic, if_clock=if_clock
        )

    async def read_modify_write(
        self,
        workspace_id: str,
        sub_doc: str,
        change: Change,
        *,
        atomic: bool = True,
        policy: ConflictRetryPolicy | None = None,
        uniform: Callable[[float, float], float] | None = None,
    ) -> list[Commit | OpRejectedError]:
        """Read the sub-doc, apply `change(state)`'s ops based on the clock read; on a
        `version_conflict`, wait and start over (docs/ops.md#conflicts).

        Call it for an update computed from the current value (a counter read and rewritten,
        a list edited): no other writer's commit is overwritten unseen. `change` may run
        several times: it must only compute ops (each run's ops get new op_ids). Retries follow
        `policy` (default `config.conflict_retry`: waits of 25, 50, 100 ms x random(0.5, 1.5),
        `uniform` drawing the factor), then the last `VersionConflictError` is raised. Other
        errors are raised as `apply_ops` raises them, not retried here.
        """
        self._check_open()
        if uniform is None:
            return await self._conditional.read_modify_write(
                workspace_id, sub_doc, change, atomic=atomic, policy=policy
            )
        return await self._conditional.read_modify_write(
            workspace_id, sub_doc, change, atomic=atomic, policy=policy, uniform=uniform
        )

    def pending_count(self, workspace_id: str | None = None, sub_doc: str | None = None) -> int:
        """Ops submitted (or replayed from the outbox) that the server has not answered yet: all
        of them, or those of one workspace, or of one of its sub-docs."""
        if workspace_id is None:
            return self._machine.pending_count
        return self._machine.pending_in(workspace_id, sub_doc)

    async def pending_ops(self, workspace_id: str, sub_doc: str) -> list[tuple[str, Op]]:
        """The sub-doc's ops the server has not answered, as `(op_id, op)`, in the order the
        server will get them: those replayed from the outbox (after a restart) first, then those
        submitted since, each once (a batch in flight included). For a view that shows what the
        user did before the server took it (`LiveDoc`).

        A restored backlog the client has not read into memory yet is read here, a page at a
        time, through the outbox (nothing is loaded into the client for it). The list is the
        client's as it stands when the call returns: an op answered during the read is not in
        it. Ops submitted later are not in it either. Raises `OutboxError` if the outbox cannot
        be read, and `RuntimeError` once the client is closed (during the read included)."""
        self._check_open()
        check_ids(workspace_id, sub_doc)
        lane = self._machine.lane_pending(workspace_id, sub_doc)
        read: list[OutboxRow] = []
        if lane.on_disk is not None:
            assert self._outbox is not None
            span, page = lane.on_disk, self._machine.restore_page
            after = span.after_seq
            while True:
                try:
                    rows = await self._outbox.read_lane(
                        workspace_id, sub_doc, after, span.up_to_seq, page
                    )
                except OutboxError:
                    self._check_open()  # closed under the read: as any verb of a closed client
                    raise
                read.extend(rows)
                if len(rows) < page:
                    break
                after = rows[-1].seq
            # Loaded, answered or discarded while the pages were read: the machine says which.
            lane = self._machine.lane_pending(workspace_id, sub_doc)
        return [(row.op_id, parse_op(orjson.loads(row.op_json))) for row in lane.with_disk(read)]

    @property
    def synced(self) -> bool:
        """True when nothing is pending: every op the app submitted has been answered."""
        return self._machine.pending_count == 0

    @property
    def sync_status(self) -> SyncStatus:
        """The pending count, the workspaces connected and those whose token was refused, now
        (`watch_sync_status` follows it)."""
        return SyncStatus(
            pending=self._machine.pending_count,
            connected=frozenset(ws for ws, sock in self._sockets.items() if sock.is_open),
            refused=self._machine.refused_workspaces()
            | {ws for ws, sock in self._sockets.items() if sock.final_error is not None},
        )

    def watch_sync_status(self) -> AsyncIterator[SyncStatus]:
        """Yield `sync_status` now, then each time it changes (ops submitted or answered, a
        workspace's websocket opened or lost), until the client closes. Coalesced: a consumer
        that falls behind gets the latest status, not every step in between. For a "saving…" /
        "saved" / "offline" indicator without polling."""
        return self._signals.watch()

    def watch_pending(self, workspace_id: str, sub_doc: str | None = None) -> AsyncIterator[int]:
        """Yield `pending_count(workspace_id, sub_doc)` now, then each time it changes, until
        the client closes: a "saving… / saved" indicator for one document. Coalesced like
        `watch_sync_status`, whose client-wide count can stay the same while this one moves
        (an op of this sub-doc answered as another's is submitted)."""
        check_ids(workspace_id, sub_doc)
        return self._signals.watch_value(lambda: self.pending_count(workspace_id, sub_doc))

    async def wait_synced(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Wait until every op submitted (or restored from the outbox) before this call has been
        answered by the server (`TimeoutError` after `timeout` seconds).

        Ops submitted meanwhile do not hold it up: "nothing pending at all" would never come
        while other tasks keep writing. Returns at once when nothing is pending, and when the
        client closes (what is left then stays in the outbox).

        Ops that gave up (`StillPendingError`) get a fresh attempt cycle: waiting for them is
        asking for them to be sent. They are otherwise retried on the next connect or submit to
        their sub-doc, and a client sending over HTTP (or the app's last op) may see neither:
        the wait ran out its whole timeout on an op nothing would send again."""
        if self._machine.pending_count == 0 or self._state == "closed":
            return
        if self._state == "open":
            self._retry_refused()
        await self._signals.wait(timeout)

    def set_token(self, token: str) -> None:
        """Use `token` from now on (a fresh one, after the old expired or was revoked).

        Ops the server refused for the old token were not answered: they wait in the outbox
        (their callers got `StillPendingError` with the `AuthError` / `ForbiddenError` as
        `last_error`) and are sent now, in order, under their op_ids. Websockets that gave up on
        the refusal connect again; subscriptions it ended must be opened again."""
        self._check_open()
        self.token_refresher.reset()
        self._adopt_token(token)

    def _adopt_token(self, token: str) -> None:
        """Send `token` from now on, and retry what waited on the old one's refusal."""
        self.token = token
        self._api().set_token(token)
        for sock in self._sockets.values():
            sock.reauthorize()
        self._machine.retry_parked()
        self._ops.kick()

    def retry_pending(self) -> None:
        """Start a fresh attempt cycle for ops that gave up (they are retried anyway on the next
        connect and the next submit to their sub-doc)."""
        self._check_open()
        self._retry_refused()

    def _retry_refused(self) -> None:
        """The app asked for another try: a fresh refresh count, websockets that gave up on a
        refusal connect again (only `set_token` did; the docs promise all three), parked lanes
        go again."""
        self.token_refresher.reset()
        for sock in self._sockets.values():
            sock.reauthorize()
        self._machine.retry_parked()
        self._ops.kick()

    async def discard_pending(self, workspace_id: str, sub_doc: str | None = None) -> int:
        """Give up, for good, on the ops of `workspace_id` (or of one sub-doc) the server has not
        answered: they leave the outbox and are never sent again, even after a crash, a power
        loss or a restart on the outbox. For ops the server will never take — access to the
        workspace revoked, a user signing out who chose to drop unsynced changes. Returns how
        many ops were discarded, once their deletion is on disk.

        Their callers get `OpDiscardedError`; its `maybe_applied` says whether an earlier send
        whose answer was lost may have applied the op (the server never applies one twice, and
        never one that no send reached). A batch in flight is not discarded: the server may be
        applying it now, so its ops get the server's answer (call again once it is back). A
        request of a discarded op that is still on its way (its answer lost, or sent by a
        process that died, and held by a proxy) may still apply it when it lands, then after
        ops submitted to the sub-doc since: this client no longer controls that request, and
        the server has no fence against it.
        Raises `OutboxError` if the outbox could not make the deletion durable: the ops are not
        sent again by this client, but their rows may still be in the file (a new client on it
        would replay them). Calling `discard_pending` for the workspace again (once the disk is
        back) retries that deletion along with its own, and counts its ops; `close()` tries it
        once more."""
        self._check_open()
        check_ids(workspace_id, sub_doc)
        self._ops.pump()  # what was submitted before this call is written first, then dropped
        count, resolve = self._machine.discard(workspace_id, sub_doc)
        # Their callers are told here alone, once the deletion is durable: out of `_futures`
        # now, a `close()` meanwhile told them "it waits in the outbox" of rows it had deleted.
        told: list[tuple[asyncio.Future[Commit], str, WorkspaceError]] = []
        for seq, outcome in resolve.outcomes if resolve is not None else ():
            entry = self._futures.pop(seq, None)
            if entry is not None and isinstance(outcome, WorkspaceError):
                told.append((entry[0], entry[1], outcome))
        # Written here, not by the pump, for its `done`: a delete that failed (a disk error, a
        # read-only file) was dropped without a word by a write with none, the app was told
        # "discarded", and the rows were replayed — and applied — by the next client.
        failed: list[BaseException] = []
        write = OutboxWrite(done=lambda error: failed.append(error) if error else None)
        for decision in self._machine.decisions():  # `discard` decides its `Discard` alone
            assert isinstance(decision, Discard)
            write.deletes.extend(decision.seqs)
            write.ranges.extend(decision.backlog)
        # The earlier discards that failed go again: their ops left the machine, so without
        # this nothing could ever delete their rows, and the next client on the file applied
        # ops the app had given up (deleting a row twice, or a range, changes nothing).
        retried = [entry for entry in self._undiscarded if entry.workspace_id == workspace_id]
        self._undiscarded = [e for e in self._undiscarded if e.workspace_id != workspace_id]
        for _, deletes, ranges, ops in retried:
            write.deletes.extend(deletes)
            write.ranges.extend(ranges)
            count += ops
        attempted = _Undiscarded(workspace_id, list(write.deletes), list(write.ranges), count)
        assert self._outbox is not None
        if write:
            self._outbox.write(write)
        self._signals.update()
        # Shielded: a discard_pending cancelled (an app's timeout) still tells the callers,
        # whom nothing else would tell (their ops are out of the machine and of `_futures`).
        settling = asyncio.ensure_future(settle_discard(self._outbox, failed, told))
        settling.add_done_callback(retrieve)

        def remember_if_failed(task: asyncio.Future[None]) -> None:
            if not task.cancelled() and task.exception() is not None:
                self._undiscarded.append(attempted)

        settling.add_done_callback(remember_if_failed)
        await asyncio.shield(settling)
        return count

    def mint_op_id(self) -> str:
        """A fresh op_id from the client's minter (the one `apply_op` uses for an op without
        one): for an app that names an op before it submits it, to submit it again after a
        cancel, say."""
        return self._mint()

    def acknowledged_clock(self, workspace_id: str, sub_doc: str) -> int:
        """The highest clock the server reported to this client for the sub-doc."""
        return self._machine.acknowledged_clock(workspace_id, sub_doc)

    # -- reads and subscriptions -------------------------------------------------------------------

    def subscribe(self, workspace_id: str, sub_doc: str, since: int = 0) -> Subscription:
        """Every committed op of the sub-doc after clock `since`, in order, each exactly once,
        reconnecting and resuming by itself (auth errors end it)."""
        self._check_open()
        check_ids(workspace_id, sub_doc)
        return Subscription(
            self,
            workspace_id,
            sub_doc,
            since=since,
            buffer=self.config.subscription_buffer,
            page=self.config.catchup_page,
        )

    async def connect(self, workspace_id: str, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Open the workspace's websocket now and wait until it is up (ops then pipeline over
        it). Optional: the client opens it by itself on first use."""
        self._check_open()
        sock = self._socket(workspace_id)
        async with asyncio.timeout(timeout):
            await sock.wait_open()

    # -- reads (the `Reads` part) -----------------------------------------------------------------

    async def get_state(self, workspace_id: str, sub_doc: str) -> tuple[int, SubDocState]:
        """The sub-doc's head clock and state (retried like any idempotent read)."""
        return await self._reads.get_state(workspace_id, sub_doc)

    async def read_ops(
        self, workspace_id: str, sub_doc: str, since: int = 0, limit: int | None = None
    ) -> tuple[int, list[Committed]]:
        """The head clock and committed ops after `since` (one page of at most `limit`)."""
        return await self._reads.read_ops(workspace_id, sub_doc, since, limit)

    # -- SocketOwner / StreamOwner -----------------------------------------------------------------

    async def read_log(
        self, workspace_id: str, sub_doc: str, since: int, limit: int
    ) -> tuple[int, Sequence[Committed | Snapshot]]:
        """A subscription's catch-up read: retried for as long as the server is down."""
        return await self._reads.read_log(workspace_id, sub_doc, since, limit)

    def holding(self) -> contextlib.AbstractContextManager[None]:
        """While held, answers only update the machine; one round acts on them all after."""
        return self._ops.holding()

    def batch_answered(self, batch_id: int, results: Any) -> None:
        self._ops.batch_answered(batch_id, results)

    def batch_failed(self, batch_id: int, error: WorkspaceError) -> None:
        self._ops.batch_failed(batch_id, error)

    def connection_opened(self, workspace_id: str) -> None:
        self._ops.connection_opened(workspace_id)

    def connection_lost(self, workspace_id: str) -> None:
        self._ops.connection_lost(workspace_id)

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None
        return self._session

    def socket_url(self, workspace_id: str) -> str:
        return self._api().socket_url(workspace_id)

    def auth_headers(self) -> dict[str, str]:
        return dict(self._api().headers)

    def register(self, sub: Subscription) -> None:
        self._check_open()
        self._subscriptions.add(sub)
        self._socket(sub.workspace_id).add(sub)

    def unregister(self, sub: Subscription) -> None:
        self._subscriptions.discard(sub)
        sock = self._sockets.get(sub.workspace_id)
        if sock is not None:
            sock.remove(sub)

    # -- helpers -----------------------------------------------------------------------------------

    def _socket(self, workspace_id: str) -> WorkspaceSocket:
        sock = self._sockets.get(workspace_id)
        if sock is None:
            sock = self._sockets[workspace_id] = WorkspaceSocket(self, workspace_id)
        sock.ensure_running()
        return sock

    def _api(self) -> HttpApi:
        if self._http is None or self._state == "closed":
            raise RuntimeError("the WorkspaceClient is not started (use `async with`)")
        return self._http

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError("the WorkspaceClient is not open (use `async with`)")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class _PumpPorts:
    """The client as its `OpPump` sees it (`PumpHost`)."""

    __slots__ = ("_client",)

    def __init__(self, client: WorkspaceClient) -> None:
        self._client = client

    @property
    def is_open(self) -> bool:
        return self._client._state == "open"

    @property
    def outbox(self) -> Outbox | None:
        return self._client._outbox

    def open_socket(self, workspace_id: str) -> WorkspaceSocket | None:
        return self._client._sockets.get(workspace_id)

    def socket(self, workspace_id: str) -> WorkspaceSocket:
        return self._client._socket(workspace_id)

    def api(self) -> HttpApi:
        return self._client._api()

    def check_open(self) -> None:
        self._client._check_open()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._client._spawn(coro)
