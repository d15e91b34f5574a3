"""`LiveDoc`: an optimistic, always-current view of one sub-doc, for an app's UI.

    async with LiveDoc(client, "ws1", "tree") as doc:
        await doc.apply_op(NodeIncrement(node_id="n", field="likes"))  # in doc.state at once
        doc.state, doc.clock, doc.pending
        async for state in doc.changes(): ...  # re-render

`doc.state` is the server's state as the sub-doc's feed delivered it, with the ops this `LiveDoc`
applied and the server has not answered on top, in order: an edit shows the moment it is made,
offline included, and moves into place as the server commits it, rebased on whatever other
clients committed first. The rules are `OptimisticDoc`'s (pure, `_optimistic.py`); this module
only wires the client's reads, subscription and answers into it.

What becomes of each op applied here:
- committed: it stays in the view (the feed confirms it where the server put it);
- rejected, discarded, or refused for good: it leaves the view, and `apply_op` raises as the
  client's does;
- no answer yet (`StillPendingError`, the app cancelled the call): it stays in the view while
  it waits in the outbox. If the server rejects it when it is replayed, nobody is told; the view
  learns it from the client itself: once nothing of the sub-doc is pending in the client and
  the feed has reached every clock the server reported to it, an op the feed never delivered
  was not committed, and it leaves the view.

Ops replayed from the outbox by a new client (after a restart) are not pending in a new
`LiveDoc`: they show once committed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from cv_mutations import Op, SubDocState
from cv_workspace_client._optimistic import Diverged, OptimisticDoc
from cv_workspace_client._pump import as_op
from cv_workspace_client.client import WorkspaceClient
from cv_workspace_client.errors import StillPendingError, WorkspaceError
from cv_workspace_client.models import Commit

if TYPE_CHECKING:
    from cv_workspace_client.stream import Subscription

__all__ = ["LiveDoc"]

logger = logging.getLogger("cv_workspace_client")


class LiveDoc:
    """The optimistic view of `sub_doc` (see the module docstring). An async context manager:
    entering reads the state and subscribes; leaving stops following (pending ops go on)."""

    def __init__(self, client: WorkspaceClient, workspace_id: str, sub_doc: str) -> None:
        self.client = client
        self.workspace_id = workspace_id
        self.sub_doc = sub_doc
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

    # -- what the app reads ------------------------------------------------------------------------

    @property
    def state(self) -> SubDocState:
        """The view: confirmed state plus pending ops. Read it; never change it (it is rebased
        in place). For a copy to keep: `SubDocState.from_json(doc.state.to_json())`."""
        return self._open().state

    @property
    def clock(self) -> int:
        """The server clock the confirmed part of the view is at."""
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
            # It waits in the outbox: still on its way, still in the view (see `_reconcile`).
            core.orphaned(parsed.op_id)
            self._reconcile()
            raise
        except BaseException:
            core.answered(parsed.op_id)  # rejected, discarded, refused: never committed
            self._changed()
            raise
        # A duplicate of a commit the view's confirmed state already holds (sent before the
        # LiveDoc read the state, or before a re-read): no feed frame will ever confirm it.
        if core.confirmed(commit.op_id, commit.clock):
            self._changed()
        return commit

    # -- lifetime ----------------------------------------------------------------------------------

    async def __aenter__(self) -> LiveDoc:
        clock, state = await self.client.get_state(self.workspace_id, self.sub_doc)
        self._core = OptimisticDoc(clock, state)
        self._subscription = self.client.subscribe(self.workspace_id, self.sub_doc, since=clock)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._follow(self._subscription)),
            loop.create_task(self._watch_sync()),
        ]
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
            async for committed in subscription:
                try:
                    core.committed(committed.clock, committed.op_id, committed.op)
                except Diverged:
                    # Never expected (the server folds the same reducers over the same log):
                    # start over from the server's word rather than show a wrong state.
                    logger.warning("live doc %s/%s diverged; re-reading", *self._key())
                    clock, state = await self.client.get_state(*self._key())
                    core.resync(clock, state)
                self._reconcile()
                self._changed()
        except WorkspaceError as exc:
            self.error = exc
        finally:
            self._following = False
            self._wake()

    async def _watch_sync(self) -> None:
        # The client answering a replayed op moves no feed clock when it is a rejection: only
        # its pending count and acknowledged clock say so.
        async for _ in self.client.watch_sync_status():
            self._reconcile()

    def _reconcile(self) -> None:
        """Ops nobody awaits leave the view once the client has nothing of the sub-doc pending
        and the feed has delivered every clock the server reported to the client: one not
        delivered by then was not committed (rejected when replayed)."""
        core = self._core
        if core is None or not core.orphans():
            return
        ws, sub_doc = self._key()
        if self.client.pending_count(ws, sub_doc):
            return
        if core.clock < self.client.acknowledged_clock(ws, sub_doc):
            return  # the feed has not caught up with what the server told the client
        for op_id in core.orphans():
            core.answered(op_id)
        self._changed()

    def _key(self) -> tuple[str, str]:
        return self.workspace_id, self.sub_doc

    def _changed(self) -> None:
        self._version += 1
        self._wake()

    def _wake(self) -> None:
        for waker in list(self._wakers):
            if not waker.done():
                waker.set_result(None)


def _with_op_id(op: Op | Mapping[str, Any], mint: Callable[[], str]) -> Op:
    """The op, with its op_id minted now (by the client's minter) if it has none: the view
    tracks it by that id, and the client keeps it for every retry (DESIGN §6)."""
    parsed = as_op(op)
    if parsed.op_id is None:
        parsed = parsed.model_copy(update={"op_id": mint()})
    return parsed
