"""The optimistic view of one sub-doc, without any I/O (`LiveDoc` is its asyncio shell).

The view is the server's state as its feed delivered it (the *confirmed* state, at `clock`) with
this client's pending ops applied on top, in the order they were submitted — what an app shows
while its edits are on their way, offline included. It is one `SubDocState`, never copied: the
reducers apply ops in place and hand back an undo (`cv_mutations.apply_op`), so a rebase undoes
the pending ops, applies what the server committed, and applies the pending ops again.

The rules, each pinned by a test:

- A committed op from the feed that is this client's oldest pending op, applied as such, is
  already in the view at the right place: it only stops being pending (the common case costs
  nothing). Any other committed op (another client's, ours out of turn, or another writer's op
  under our op's op_id) is a rebase.
- An op the server says is committed at a clock the confirmed state already holds (a duplicate
  of a commit from before the view read the state, the feed after a `resync`) is in the
  confirmed state: it stops being pending, or the view would show it twice for good.
- One op_id is one pending op: the same op applied again (a retry after a cancel) shows once,
  as the server applies it once.
- A pending op the view cannot take (the local reducer refuses it: another client deleted its
  node, say) stays pending, unapplied: the server decides, and a later rebase may apply it.
- An op the server answered without committing it (rejected, discarded, a final error) leaves.
- A committed op the confirmed state cannot take means this copy diverged from the server (it
  never should: the server folds the same reducers over the same log). `Diverged` is raised and
  the shell starts over from a fresh server state (`resync`), pending ops re-applied. Until
  then the view stays as it was, pending ops included (the shell's re-read may take a while).
- A `resync` to a state at a clock (a re-read, or a subscription's `Snapshot` in place of
  compacted ops) drops the pending ops the server said are committed at or below that clock
  (they are in that state) and applies the others again on top of it.
- Ops a new view finds in the client's outbox (`waiting`: resent after a restart) are pending
  like the app's, with nobody waiting for their answer (orphans) from the start.
"""

from __future__ import annotations

from dataclasses import dataclass

from cv_mutations import Op, OpRejected, SubDocState, Undo, apply_op

__all__ = ["Diverged", "OptimisticDoc"]


class Diverged(Exception):
    """The feed delivered an op the confirmed state cannot take: start over (`resync`)."""


@dataclass(slots=True, eq=False)
class _Pending:
    op_id: str
    op: Op
    #: How to take it out of the view; None while the view cannot take it.
    undo: Undo | None
    #: Its caller stopped waiting (`StillPendingError`, a cancel): only the feed, or the shell's
    #: reconciliation (`orphans`), can say what became of it.
    orphan: bool = False
    #: The clock the server answered it committed at, while the feed has not reached it: a
    #: `resync` to a state at or past it drops the op (it is in that state).
    clock: int | None = None


class OptimisticDoc:
    """Confirmed state + pending ops = `state`, kept current as ops come and go.

    Args:
        clock: the server clock `state` is at.
        state: the server's state at `clock`; the view is built in it (the caller hands it over).
    """

    def __init__(self, clock: int, state: SubDocState) -> None:
        self.clock = clock
        #: The view. Read it, never change it: it is rebased in place.
        self.state = state
        self._pending: list[_Pending] = []

    @property
    def pending(self) -> tuple[Op, ...]:
        """This client's ops the server has not answered, in submission order."""
        return tuple(p.op for p in self._pending)

    def is_pending(self, op_id: str) -> bool:
        return any(p.op_id == op_id for p in self._pending)

    def snapshot(self) -> tuple[int, SubDocState]:
        """A copy of the confirmed state, at `clock`: the view without its pending ops. What an
        app may keep to open a view with later (`LiveDoc(initial=...)`), where the outbox's
        pending ops are applied again: a copy of `state` would show them twice. O(the doc)."""
        undone = [p for p in reversed(self._pending) if p.undo is not None]
        for p in undone:  # in the reverse of the order applied
            assert p.undo is not None
            p.undo()
            p.undo = None
        try:
            return self.clock, SubDocState.from_json(self.state.to_json())
        finally:
            for p in self._pending:
                p.undo = self._try(p.op)

    def orphans(self) -> list[str]:
        """Pending ops nobody waits for (see `_Pending.orphan`)."""
        return [p.op_id for p in self._pending if p.orphan]

    # -- events ------------------------------------------------------------------------------------

    def local(self, op_id: str, op: Op) -> bool:
        """The app submitted `op`: it is pending, and in the view if the view can take it (the
        return value)."""
        for p in self._pending:
            if p.op_id == op_id:
                # The same op sent again (the SDK's advice after a cancel): the server applies it
                # once, so the view shows it once. Someone waits for its answer again.
                p.orphan = False
                return p.undo is not None
        undo = self._try(op)
        self._pending.append(_Pending(op_id, op, undo))
        return undo is not None

    def waiting(self, op_id: str, op: Op) -> bool:
        """An op already in the client's outbox that nobody here awaits (resent after a
        restart, listed when the view opened): pending and orphaned from the start (`local`
        then `orphaned`). Returns whether the view can take it."""
        shown = self.local(op_id, op)
        self.orphaned(op_id)
        return shown

    def committed(self, clock: int, op_id: str | None, op: Op) -> None:
        """The feed delivered the op committed at `clock` (in clock order; older ones ignored).
        Raises `Diverged` if the confirmed state cannot take it."""
        if clock <= self.clock:
            # Not news for the state, but it may be news for a pending op: after a `resync` the
            # feed goes on delivering clocks the re-read state already holds, ours among them.
            if op_id is not None:
                self.confirmed(op_id, clock)
            return
        if self._is_head(op_id, op):
            # Applied on top of the confirmed state, first of the pending ops: it is where the
            # server put it. It joins the confirmed state as it stands.
            self._pending.pop(0)
        else:
            self._rebase(op, op_id)
        self.clock = clock

    def confirmed(self, op_id: str, clock: int) -> bool:
        """The server said `op_id` is committed at `clock` (its answer to us, a duplicate's
        included). If the confirmed state already holds that clock, the op is in it: it leaves
        the view (returns whether it was there). Otherwise the feed has yet to deliver it, and
        `committed` will."""
        if clock > self.clock:
            for p in self._pending:
                if p.op_id == op_id:
                    p.clock = clock
            return False
        if not self.is_pending(op_id):
            return False
        self._rebase(None, op_id)
        return True

    def answered(self, op_id: str) -> None:
        """The server answered `op_id` without committing it: it leaves the view."""
        if self.is_pending(op_id):
            self._rebase(None, op_id)

    def orphaned(self, op_id: str) -> None:
        """Nobody waits for `op_id`'s answer any more; it stays pending (it is in the outbox)."""
        for p in self._pending:
            if p.op_id == op_id:
                p.orphan = True

    def resync(self, clock: int, state: SubDocState) -> None:
        """Start over from the server's `state` at `clock`, pending ops applied on it (those the
        server answered as committed at or below `clock` are in it: they leave)."""
        self.clock = clock
        self.state = state
        self._pending = [p for p in self._pending if p.clock is None or p.clock > clock]
        for p in self._pending:
            p.undo = self._try(p.op)

    # -- internals ---------------------------------------------------------------------------------

    def _is_head(self, op_id: str | None, op: Op) -> bool:
        """Is the committed op our oldest pending op, in the view where the server put it?

        Only if it is the same op: an op_id is unique in the log, not across writers, and an app
        that reuses one for another op gets `op_id_reuse` for ours while theirs is committed."""
        if op_id is None or not self._pending:
            return False
        head = self._pending[0]
        return head.op_id == op_id and head.undo is not None and _same_op(head.op, op)

    def _try(self, op: Op) -> Undo | None:
        try:
            return apply_op(self.state, op)
        except OpRejected:
            return None

    def _rebase(self, committed: Op | None, op_id: str | None) -> None:
        """Take the pending ops out, apply `committed` to the confirmed state (and drop the
        pending op `op_id`), put the pending ops back."""
        for p in reversed(self._pending):  # undone in the reverse of the order applied
            if p.undo is not None:
                p.undo()
                p.undo = None
        try:
            if committed is not None:
                try:
                    apply_op(self.state, committed)
                except OpRejected as exc:
                    raise Diverged(
                        f"the confirmed state cannot take a committed op: {exc}"
                    ) from exc
            if op_id is not None:
                self._pending = [p for p in self._pending if p.op_id != op_id]
        finally:
            # Diverged included: the view keeps showing every pending op (its confirmed part
            # as it was) while the shell re-reads the server, which may take a while.
            for p in self._pending:
                p.undo = self._try(p.op)


def _same_op(ours: Op, committed: Op) -> bool:
    """The same op, whether or not the feed's copy carries the op_id: O(the op), never the doc."""
    if ours == committed:
        return True
    return ours.model_dump(exclude={"op_id"}) == committed.model_dump(exclude={"op_id"})
