"""Carrying out the outbox machine's decisions: `OpPump`, the part of `WorkspaceClient` that
moves ops (the client holds one and hands it what it needs as a `PumpHost`).

Ops enter here (`_submit`: the op_id is minted before the op is written anywhere), and every
decision `OutboxMachine` takes — persist, send, resolve, wait, load a page of a restored backlog —
is carried out by `_pump`, which then feeds back what happened (written, answered, failed, timer
fired). The machine decides; this module only does.

Batching without per-op work: submissions made in the same event-loop tick are persisted with one
outbox write (one commit, one fsync on the outbox's syncer thread), the machine sends whatever is
pending for a sub-doc as one batch as soon as the previous one is answered, the socket packs the
applies queued meanwhile into one message, and the acks of one message are acted on together
(`holding`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from typing import Any, Protocol

from cv_mutations import InvalidOp, Op, parse_op
from cv_workspace_client._core.machine import (
    CountAttempt,
    Forget,
    Load,
    OutboxMachine,
    Persist,
    Resolve,
    Restamp,
    Send,
    Wait,
)
from cv_workspace_client._io.http import HttpApi
from cv_workspace_client._io.reads import check_ids
from cv_workspace_client._io.socket import WorkspaceSocket
from cv_workspace_client._io.status import SyncSignals
from cv_workspace_client._outbox.base import Outbox, OutboxWrite
from cv_workspace_client.config import ClientConfig
from cv_workspace_client.errors import (
    ConnectionFailedError,
    InvalidRequestError,
    OutboxError,
    StillPendingError,
    WorkspaceError,
)
from cv_workspace_client.models import Commit

__all__ = ["OpLike", "OpPump", "PumpHost", "as_op"]

OpLike = Op | Mapping[str, Any]


class PumpHost(Protocol):
    """What the pump needs from the client that owns it."""

    @property
    def is_open(self) -> bool:
        """Started and not closing: decisions to send, wait or load are carried out."""
        ...

    @property
    def outbox(self) -> Outbox | None: ...

    def open_socket(self, workspace_id: str) -> WorkspaceSocket | None:
        """The workspace's websocket if one exists (opened by an op or a subscription)."""
        ...

    def socket(self, workspace_id: str) -> WorkspaceSocket:
        """The workspace's websocket, connecting it if needed."""
        ...

    def api(self) -> HttpApi: ...

    def check_open(self) -> None:
        """Raise `RuntimeError` unless the client is open."""
        ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` as a task the client cancels when it closes."""
        ...


class OpPump:
    """The decision carrier: feeds the outbox machine what happened and does what it decides.

    Args:
        host: the client (`PumpHost`).
        config: the client's configuration.
        machine: the outbox machine whose decisions are carried out.
        signals: told after each round, for `sync_status` watchers.
        futures: the callers' futures by outbox seq (shared with the client, which fails
            those still waiting when it closes).
        mint: the op_id minter (`WorkspaceClient(new_op_id=...)`).
    """

    def __init__(
        self,
        host: PumpHost,
        *,
        config: ClientConfig,
        machine: OutboxMachine,
        signals: SyncSignals,
        futures: dict[int, tuple[asyncio.Future[Commit], str]],
        mint: Callable[[], str],
    ) -> None:
        self._host = host
        self.config = config
        self._machine = machine
        self._signals = signals
        self._futures = futures
        self._mint = mint
        self._pump_handle: asyncio.Handle | None = None
        self._pumping = False
        self._holds = 0

    def submit(
        self, workspace_id: str, sub_doc: str, ops: Sequence[OpLike], *, atomic: bool
    ) -> list[asyncio.Future[Commit]]:
        """Mint op_ids, hand the ops to the machine, and schedule one outbox write for the
        tick; the futures resolve with each op's answer."""
        return self._submit(workspace_id, sub_doc, ops, atomic=atomic)

    def pump(self) -> None:
        """Carry out every decision taken so far (the scheduled round, now)."""
        self._pump()

    def kick(self) -> None:
        """Something happened: act on it now (or as soon as the running pump or hold ends)."""
        self._kick()

    def cancel_scheduled(self) -> None:
        """Drop the round scheduled for this tick (the client is closing)."""
        if self._pump_handle is not None:
            self._pump_handle.cancel()
            self._pump_handle = None

    def _submit(
        self, workspace_id: str, sub_doc: str, ops: Sequence[OpLike], *, atomic: bool
    ) -> list[asyncio.Future[Commit]]:
        self._host.check_open()
        check_ids(workspace_id, sub_doc)
        raws: list[dict[str, Any]] = []
        for op in ops:
            raw = as_op(op).model_dump(mode="json", exclude_none=True)
            if "op_id" not in raw:
                # Minted once, here, before the op is written anywhere: its identity from now on.
                raw["op_id"] = self._mint()
            raws.append(raw)
        rows = self._machine.submit(workspace_id, sub_doc, raws, atomic=atomic)
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Commit]] = []
        for row in rows:
            future: asyncio.Future[Commit] = loop.create_future()
            self._futures[row.seq] = (future, row.op_id)
            futures.append(future)
        if self.config.ops_over_websocket:
            self._host.socket(workspace_id)
        if self._pump_handle is None:
            # Everything submitted in this tick shares one outbox write.
            self._pump_handle = loop.call_soon(self._pump)
        return futures

    def _pump(self) -> None:
        """Carry out the machine's decisions until it has none left."""
        self._pump_handle = None
        if self._pumping:
            return
        self._pumping = True
        try:
            outbox = self._host.outbox
            assert outbox is not None
            sending = self._host.is_open
            while decisions := self._machine.decisions():
                write = OutboxWrite()
                for decision in decisions:
                    if isinstance(decision, Send):
                        if sending:
                            self._send(decision)
                    elif isinstance(decision, Resolve):
                        self._resolve(decision)
                    elif isinstance(decision, Persist):
                        write.inserts.extend(decision.rows)
                    elif isinstance(decision, Restamp):
                        # A write of its own: its rows are answered by `restamped`, not
                        # `persisted`, and an insert's failure must not undo them.
                        restamp = OutboxWrite(
                            restamps=list(decision.rows),
                            lane_seqs=list(decision.lane_seqs),
                            done=functools.partial(
                                self._restamped, [row.seq for row in decision.rows]
                            ),
                        )
                        outbox.write(restamp)
                    elif isinstance(decision, Forget):
                        write.deletes.extend(decision.seqs)
                    elif isinstance(decision, CountAttempt):
                        write.attempts.extend(decision.seqs)
                    elif isinstance(decision, Wait) and sending:
                        self._spawn(self._wait(decision))
                    elif isinstance(decision, Load) and sending:
                        self._spawn(self._load(decision))
                if write:
                    if write.inserts:
                        seqs = [row.seq for row in write.inserts]
                        write.done = functools.partial(self._written, seqs)
                    outbox.write(write)
        finally:
            self._pumping = False
        self._signals.update()

    def _kick(self) -> None:
        """Something happened: act on it now (or as soon as the running pump or hold ends)."""
        if self._host.is_open and not self._holds:
            self._pump()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Feed several answers to the machine, then act on all they decided at once."""
        self._holds += 1
        try:
            yield
        finally:
            self._holds -= 1
            self._kick()

    def _written(self, seqs: list[int], error: BaseException | None) -> None:
        if error is None:
            self._machine.persisted(seqs)
        else:
            self._machine.persist_failed(seqs, error)
        self._kick()

    def _restamped(self, seqs: list[int], error: BaseException | None) -> None:
        self._machine.restamped(seqs, error)
        self._kick()

    def _send(self, send: Send) -> None:
        # `ops_over_websocket=False` is HTTP only, even when a subscription opened the socket.
        sock = self._host.open_socket(send.workspace_id) if self.config.ops_over_websocket else None
        if sock is not None and sock.send_batch(send):
            return
        self._spawn(self._post(send))

    async def _post(self, send: Send) -> None:
        # A refusal of a token replaced while the request was out (`set_token`, a refresh) is
        # not reported: `HttpApi.request` sends it again with the new one (`with_token`).
        try:
            results = await self._host.api().post_ops(send.workspace_id, send.sub_doc, send.body())
        except WorkspaceError as exc:
            self._machine.batch_failed(send.batch_id, exc)
        except Exception as exc:
            # Anything else (a library surprise, a warning turned into an error) must still be
            # reported: a batch left in flight forever wedges its lane, every later op of the
            # sub-doc and `wait_synced` hang. Whether the request reached the server is unknown,
            # so it is retried under its op_ids like a lost connection.
            error = ConnectionFailedError("send_failed", f"{type(exc).__name__}: {exc}")
            self._machine.batch_failed(send.batch_id, error)
        else:
            self._machine.batch_answered(send.batch_id, results)
        self._kick()

    async def _wait(self, wait: Wait) -> None:
        await self.config.sleep(wait.delay)
        self._machine.timer_fired(wait.workspace_id, wait.sub_doc, wait.token)
        self._kick()

    async def _load(self, load: Load) -> None:
        outbox = self._host.outbox
        assert outbox is not None
        try:
            rows = await outbox.read_lane(
                load.workspace_id, load.sub_doc, load.after_seq, load.up_to_seq, load.limit
            )
        except OutboxError as exc:
            self._machine.load_failed(load.workspace_id, load.sub_doc, exc)
        else:
            self._machine.loaded(load.workspace_id, load.sub_doc, rows)
        self._kick()

    def _resolve(self, resolve: Resolve) -> None:
        outbox = self._host.outbox
        for seq, outcome in resolve.outcomes:
            entry = self._futures.pop(seq, None)
            if entry is None or entry[0].done():
                continue
            if isinstance(outcome, Commit):
                entry[0].set_result(outcome)
            elif (
                isinstance(outcome, StillPendingError)
                and outbox is not None
                and not outbox.synced(seq)
            ):
                # "It waits in the outbox" must be true of the disk, not just of the page cache.
                self._spawn(self._still_pending_once_synced(seq, entry[0], outcome))
            else:
                entry[0].set_exception(outcome)

    async def _still_pending_once_synced(
        self, seq: int, future: asyncio.Future[Commit], outcome: StillPendingError
    ) -> None:
        outbox = self._host.outbox
        assert outbox is not None
        error: BaseException = outcome
        try:
            await outbox.sync(seq)
        except OutboxError as exc:
            error = exc
        finally:  # cancelled by close(): the close's own final fsync covers the row
            if not future.done():
                future.set_exception(error)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._host.spawn(coro)

    # -- answers from the sockets (SocketOwner) ---

    def batch_answered(self, batch_id: int, results: Any) -> None:
        self._machine.batch_answered(batch_id, results)
        self._kick()

    def batch_failed(self, batch_id: int, error: WorkspaceError) -> None:
        self._machine.batch_failed(batch_id, error)
        self._kick()

    def connection_opened(self, workspace_id: str) -> None:
        self._machine.connection_opened(workspace_id)
        self._kick()
        self._signals.update()

    def connection_lost(self, workspace_id: str) -> None:
        self._signals.update()


def as_op(op: OpLike) -> Op:
    """The op as the typed model: a mapping is parsed (`InvalidRequestError` if it is not one),
    a model passed through. Shared with `LiveDoc`."""
    if isinstance(op, Mapping):
        try:
            return parse_op(dict(op))
        except InvalidOp as exc:
            raise InvalidRequestError(exc.code, exc.message) from None
    return op
