"""`LiveDoc`: an optimistic, always-current view of one sub-doc, for an app's UI.

    async with LiveDoc(client, "ws1", "tree") as doc:
        await doc.apply_op(NodeIncrement(node_id="n", field="likes"))  # in doc.state at once
        doc.state, doc.clock, doc.pending
        async for state in doc.changes(): ...  # re-render

`doc.state` is the server's state as the sub-doc's feed delivered it, with the ops the server has
not answered on top, in order (those applied here, and those the client's outbox held when the
view opened): an edit shows the moment it is made,
offline included, and moves into place as the server commits it, rebased on whatever other
clients committed first. The rules are `OptimisticDoc`'s (pure, `_core/optimistic.py`); this module
only wires the client's reads, subscription and answers into it.

Opening: the state comes first (`get_state`, or the `initial` state the app cached, for a view
that opens with no server), then the client's unanswered ops of the sub-doc
(`WorkspaceClient.pending_ops`: those a new client resends from its outbox after a restart, in
outbox order), shown on top of it, then the feed follows from the state's clock. A user who edited
offline, quit and reopened the app sees those edits at once, server or no server. An op that
the server committed before the state was read but had not answered when the ops were listed
(its answer on the way, or lost to a crash: the resend gets `duplicate`) shows twice until the
rule below takes it out; every other interleaving of answers with the open is exact.

What becomes of each op in the view:
- committed: it stays in the view (the feed confirms it where the server put it);
- rejected, discarded before any send, or refused for good: it leaves the view, and `apply_op`
  raises as the client's does;
- no answer yet (`StillPendingError`, the app cancelled the call, found in the outbox at open),
  or discarded after a send whose answer was lost (`OpDiscardedError.maybe_applied`): it stays
  in the view while its fate is unknown. Nobody is told what the server made of it; the view
  learns it from the client and the server: once nothing of the sub-doc is pending in the
  client, every such op was answered or discarded, so any commit of one is at or below the
  server's head clock read after that moment (and the clocks the server reported to the
  client). Once the feed has reached them, an op it never delivered was not committed, and it
  leaves the view — once, never to come back.

If the view ever diverges from the server (it never should), it re-reads the state, retrying
with the client's backoff until the server answers; meanwhile it shows what it showed, pending
ops included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from cv_mutations import Op, SubDocState
from cv_workspace_client._core.optimistic import Diverged, OptimisticDoc
from cv_workspace_client._io.pump import as_op
from cv_workspace_client._io.retry import retrying
from cv_workspace_client.client import WorkspaceClient
from cv_workspace_client.errors import (
    InvalidRequestError,
    LogCompactedError,
    OpDiscardedError,
    StillPendingError,
    WorkspaceError,
)
from cv_workspace_client.models import Commit, Snapshot

if TYPE_CHECKING:
    from cv_workspace_client.stream import Subscription

__all__ = ["LiveDoc"]

logger = logging.getLogger("cv_workspace_client")


class LiveDoc:
    """The optimistic view of `sub_doc` (see the module docstring). An async context manager:
    entering reads the state and subscribes; leaving stops following (pending ops go on)."""

    def __init__(
        self,
        client: WorkspaceClient,
        workspace_id: str,
        sub_doc: str,
        *,
        initial: tuple[int, SubDocState] | None = None,
    ) -> None:
        """`initial`: a state of the sub-doc the app kept (`(clock, state)`, as `get_state`
        returns it) to open from instead of reading the server's, so the view opens with no
        server; it follows from that clock once the server is reachable. Copied: the app's
        copy is left alone."""
        self.client = client
        self.workspace_id = workspace_id
        self.sub_doc = sub_doc
        self.initial = initial
        #: Why the view stopped following the server (the subscription's error), or None.
        self.error: BaseException | None = None
        self._core: OptimisticDoc | None = None
        self._subscription: Subscription | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._version = 0
        self._wakers: set[asyncio.Future[None]] = set()
        self._closed = False
        #: False once the feed ended (the client closed, or `error`).
        self._following = True
        #: Set when the orphans' fate may be decidable (see `_settle_orphans`).
        self._recheck = asyncio.Event()

    # -- what the app reads ------------------------------------------------------------------------

    @property
    def state(self) -> SubDocState:
        """The view: confirmed state plus pending ops. Read it; never change it (it is rebased
        in place). For a copy to keep: `SubDocState.from_json(doc.state.to_json())`."""
        return self._open().state

    def snapshot(self) -> tuple[int, SubDocState]:
        """`(clock, state)`: a copy of the server's state the view is built on, without the
        pending ops. Keep it to open a view later with no server (`initial=`): the ops still
        pending then are in the outbox and are applied on it again, so a copy of `state`
        (pending ops included) would show them twice."""
        return self._open().snapshot()

    @property
    def clock(self) -> int:
        """The server clock the confirmed part of the view is at: the clock to base a
        compare-and-set write on (`apply_ops(..., if_clock=doc.clock)`, computed from
        `doc.snapshot()`'s state; docs/ops.md#conflicts). While `pending` is not empty, those ops
        may commit first and turn such a write into a `version_conflict`."""
        return self._open().clock

    @property
    def pending(self) -> tuple[Op, ...]:
        """Ops applied here that the server has not answered, in order."""
        return self._open().pending

    async def changes(self) -> AsyncIterator[SubDocState]:
        """Yield `state` now, then each time it changes; a consumer that falls behind gets the
        latest view, not every step. Ends when the `LiveDoc` closes or stops following (then
        `error` says why)."""
        seen = -1
        while True:
            if self._version != seen:
                seen = self._version
                yield self.state
                continue
            if self._closed or not self._following:
                return
            waker: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._wakers.add(waker)
            try:
                await waker
            finally:
                self._wakers.discard(waker)

    # -- what the app does -------------------------------------------------------------------------

    async def apply_op(self, op: Op | Mapping[str, Any]) -> Commit:
        """Apply `op` through the client (see `WorkspaceClient.apply_op`), showing it in `state`
        at once. Raises what the client's `apply_op` raises; `RuntimeError` once the `LiveDoc`
        is closed (the op would be sent, and shown nowhere)."""
        core = self._open()
        if self._closed:
            raise RuntimeError("the LiveDoc is closed")
        parsed = _with_op_id(op, self.client.mint_op_id)
        assert parsed.op_id is not None
        core.local(parsed.op_id, parsed)
        self._changed()
        try:
            commit = await self.client.apply_op(self.workspace_id, self.sub_doc, parsed)
        except (StillPendingError, asyncio.CancelledError):
            # It waits in the outbox: still on its way, still in the view (`_settle_orphans`).
            core.orphaned(parsed.op_id)
            self._recheck.set()
            raise
        except OpDiscardedError as exc:
            if exc.maybe_applied:
                # A send whose answer was lost may have committed it: the feed will say. Taken
                # out now, it came back with that commit (a flicker) whenever it was committed.
                core.orphaned(parsed.op_id)
                self._recheck.set()
            else:
                core.answered(parsed.op_id)  # never sent: never committed
                self._changed()
            raise
        except BaseException:
            core.answered(parsed.op_id)  # rejected, refused: never committed
            self._changed()
            raise
        # A duplicate of a commit the view's confirmed state already holds (sent before the
        # LiveDoc read the state, or before a re-read): no feed frame will ever confirm it.
        if core.confirmed(commit.op_id, commit.clock):
            self._changed()
        return commit

    # -- lifetime ----------------------------------------------------------------------------------

    async def __aenter__(self) -> LiveDoc:
        ws, sub_doc = self._key()
        if self.initial is None:
            clock, state = await self.client.get_state(ws, sub_doc)
        else:
            clock, state = self.initial[0], SubDocState.from_json(self.initial[1].to_json())
        core = OptimisticDoc(clock, state)
        # Listed after the state was read: an op answered before the list is in the state (or
        # the feed brings it), one answered after is pending here until the feed confirms it
        # (or `_settle_orphans` finds it was not committed after the read). Nothing awaits
        # between the list and the view taking it: no answer slips in between.
        for op_id, op in await self.client.pending_ops(ws, sub_doc):
            core.waiting(op_id, op)
        self._core = core
        self._subscription = self.client.subscribe(ws, sub_doc, since=clock)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._follow(self._subscription)),
            loop.create_task(self._watch_sync()),
            loop.create_task(self._settle_orphans()),
        ]
        self._recheck.set()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop following the server. Ops applied here go on in the client's outbox."""
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._subscription is not None:
            await self._subscription.aclose()
        self._wake()

    # -- internals ---------------------------------------------------------------------------------

    def _open(self) -> OptimisticDoc:
        if self._core is None:
            raise RuntimeError("the LiveDoc is not open (use `async with`)")
        return self._core

    async def _follow(self, subscription: Subscription) -> None:
        core = self._open()
        try:
            try:
                await self._follow_one(core, subscription)
            except InvalidRequestError:
                if self.initial is None or core.clock != self.initial[0]:
                    raise
                # The kept state is ahead of the server's log (the server restored from an
                # older copy, or another deployment's state): nothing to follow from there.
                # Start over from the server's word, pending ops kept, rather than show the
                # kept state for good.
                logger.warning(
                    "live doc %s/%s: its initial clock %d is past the server's; re-reading",
                    *self._key(),
                    core.clock,
                )
                clock, state = await self._reread()
                core.resync(clock, state)
                self._changed()
                await subscription.aclose()
                subscription = self.client.subscribe(*self._key(), since=clock)
                self._subscription = subscription
                await self._follow_one(core, subscription)
        except WorkspaceError as exc:
            self.error = exc
        except _ClientClosed:
            pass
        finally:
            self._following = False
            self._recheck.set()
            self._wake()

    async def _follow_one(self, core: OptimisticDoc, subscription: Subscription) -> None:
        async for committed in subscription:
            if isinstance(committed, Snapshot):
                # The ops up to its clock were compacted: start over from the server's state
                # there, this client's pending ops applied on top (docs/client.md;
                # `test_a_live_doc_with_pending_ops_resets_to_a_snapshot_and_keeps_them`).
                core.resync(committed.clock, committed.state)
                self._recheck.set()
                self._changed()
                continue
            try:
                core.committed(committed.clock, committed.op_id, committed.op)
            except Diverged:
                # Never expected (the server folds the same reducers over the same log): start
                # over from the server's word rather than show a wrong state. The view shows
                # what it did meanwhile, pending ops included.
                logger.warning("live doc %s/%s diverged; re-reading", *self._key())
                clock, state = await self._reread()
                core.resync(clock, state)
            self._recheck.set()
            self._changed()

    async def _reread(self) -> tuple[int, SubDocState]:
        """The server's state, however long it takes to reach it: the client's backoff between
        tries (`get_state` retries `retry_attempts` times itself). A final error raises."""
        found: tuple[int, SubDocState] | None = None
        async for attempt in retrying(self.client.config, forever=True):
            with attempt, _closing_client():
                found = await self.client.get_state(*self._key())
        assert found is not None
        return found

    async def _head(self) -> int:
        """The server's head clock now, retried as `_reread`."""
        head = 0
        async for attempt in retrying(self.client.config, forever=True):
            with attempt, _closing_client():
                try:
                    head, _ = await self.client.read_ops(*self._key(), since=0, limit=1)
                except LogCompactedError as exc:  # the 410 names the head too
                    if exc.clock is None:
                        raise
                    head = exc.clock
        return head

    async def _watch_sync(self) -> None:
        # The client answering (or discarding) a resent op moves no feed clock: only the
        # sub-doc's pending count says so (not the client-wide one, which may not move).
        async for _ in self.client.watch_pending(*self._key()):
            self._recheck.set()
        # The client closed. A read retried with backoff (`_reread`, `_head`) would go on
        # until its delay ended (up to `retry_cap_seconds`), the view with it: stop it now.
        this = asyncio.current_task()
        for task in self._tasks:
            if task is not this:
                task.cancel()

    async def _settle_orphans(self) -> None:
        """Take out the ops nobody awaits (`OptimisticDoc.orphans`) that were not committed.

        Once the client has nothing of the sub-doc pending, each of them was answered or
        discarded, so a commit of one is at or below the head the server reports after that
        moment, and at or below the clocks the server reported to the client. The feed confirms
        what was committed by the time it reaches them; what is still an orphan then was not
        (rejected when resent, discarded, or in the state before the view read it)."""
        core = self._open()
        ws, sub_doc = self._key()
        try:
            while self._following:
                await self._recheck.wait()
                self._recheck.clear()
                if not core.orphans() or self.client.pending_count(ws, sub_doc):
                    continue
                candidates = set(core.orphans())
                # Not the acknowledged clock alone: a discard moves none, and a send whose
                # answer was lost may have committed an op that only the feed will show.
                head = await self._head()
                while core.clock < max(head, self.client.acknowledged_clock(ws, sub_doc)):
                    if not self._following:
                        return  # the feed ended: the view is as it stands for good
                    await self._recheck.wait()
                    self._recheck.clear()
                if self.client.pending_count(ws, sub_doc):
                    continue  # sent again meanwhile: its answer will wake this again
                gone = [op_id for op_id in core.orphans() if op_id in candidates]
                for op_id in gone:
                    core.answered(op_id)
                if gone:
                    self._changed()
                if any(op_id not in candidates for op_id in core.orphans()):
                    # Orphaned during this pass: the wake-ups they brought were spent on its
                    # wait, and none may come again (nothing pending, the feed at the head).
                    self._recheck.set()
        except WorkspaceError as exc:
            logger.warning("live doc %s/%s cannot settle its orphan ops: %s", ws, sub_doc, exc)
        except _ClientClosed:
            pass

    def _key(self) -> tuple[str, str]:
        return self.workspace_id, self.sub_doc

    def _changed(self) -> None:
        self._version += 1
        self._wake()

    def _wake(self) -> None:
        for waker in list(self._wakers):
            if not waker.done():
                waker.set_result(None)


class _ClientClosed(Exception):
    """The client closed under a read (its `RuntimeError`): the view stops quietly."""


@contextlib.contextmanager
def _closing_client() -> Iterator[None]:
    try:
        yield
    except RuntimeError as exc:
        # Raised by a client that is not open (closed under the view, which ends with it).
        raise _ClientClosed(str(exc)) from exc


def _with_op_id(op: Op | Mapping[str, Any], mint: Callable[[], str]) -> Op:
    """The op, with its op_id minted now (by the client's minter) if it has none: the view
    tracks it by that id, and the client keeps it for every retry (docs/client.md)."""
    parsed = as_op(op)
    if parsed.op_id is None:
        parsed = parsed.model_copy(update={"op_id": mint()})
    return parsed
