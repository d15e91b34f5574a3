"""A subscriber's side of a broadcast on its own, no server, no socket: client CPU per delivered op.

What one `WorkspaceClient` does with each websocket message of `op` frames once the bytes have
arrived: decode the message, hand each frame to the subscriptions of its sub-doc (`op` parsed
once per frame), and wake the task iterating each subscription, which reads `committed.op.meta`
as the bench's subscribers do. The shape is the 16 + 16 workload's: 16 subscriptions (one per
sub-doc) on one socket, 8 frames per message. CPU is the process's, per delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Iterator
from typing import Any, cast

import orjson

from bench._client_outbox import OutboxFigure
from cv_workspace_client._io.socket import SocketOwner, WorkspaceSocket
from cv_workspace_client.models import Committed, Snapshot
from cv_workspace_client.stream import Subscription

__all__ = ["measure_delivery"]

SUB_DOCS = 16
FRAMES_PER_MESSAGE = 8


class _Owner:
    """What the socket and its subscriptions ask of the client, and nothing happens."""

    def register(self, sub: Subscription) -> None:
        pass

    def unregister(self, sub: Subscription) -> None:
        pass

    async def read_log(
        self, workspace_id: str, sub_doc: str, since: int, limit: int
    ) -> tuple[int, list[Committed]]:
        raise AssertionError("a gap-free stream never reads the log")

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        yield


def _messages(deliveries: int) -> list[str]:
    clocks = dict.fromkeys((f"d{i}" for i in range(SUB_DOCS)), 0)
    frames: list[dict[str, Any]] = []
    for n in range(deliveries):
        sub_doc = f"d{n % SUB_DOCS}"
        clocks[sub_doc] += 1
        op_id = f"bench{n:016d}"
        op = {
            "type": "node.increment",
            "op_id": op_id,
            "node_id": "root",
            "field": "w0",
            "by": 1,
            "meta": {"t": time.time()},
        }
        frames.append(
            {"type": "op", "sub_doc": sub_doc, "clock": clocks[sub_doc], "op_id": op_id, "op": op}
        )
    return [
        orjson.dumps(frames[i : i + FRAMES_PER_MESSAGE]).decode()
        for i in range(0, len(frames), FRAMES_PER_MESSAGE)
    ]


async def _deliver(deliveries: int) -> tuple[int, float, float]:
    owner = _Owner()
    sock = WorkspaceSocket(cast(SocketOwner, owner), "bench")
    subs = [
        Subscription(owner, "bench", f"d{i}", since=0, buffer=deliveries, page=1000)
        for i in range(SUB_DOCS)
    ]
    for sub in subs:
        sock._subs.setdefault(sub.sub_doc, []).append(weakref.ref(sub))
    seen = 0

    async def consume(sub: Subscription, last: int) -> None:
        nonlocal seen
        async for committed in sub:
            if isinstance(committed, Snapshot):  # the bench never compacts
                continue
            meta = committed.op.meta
            if meta is not None and committed.clock > 0:
                seen += 1
            if committed.clock == last:
                return

    per_doc = deliveries // SUB_DOCS
    readers = [asyncio.create_task(consume(sub, per_doc)) for sub in subs]
    messages = _messages(per_doc * SUB_DOCS)
    await asyncio.sleep(0)  # every reader waits on its subscription
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for message in messages:
        sock._dispatch(message)
        await asyncio.sleep(0)  # as the socket's reader does between messages
    await asyncio.gather(*readers)
    return seen, time.perf_counter() - wall0, time.process_time() - cpu0


def measure_delivery(*, quick: bool) -> OutboxFigure:
    """The best of three runs (bounded: 16,000 or 4,000 deliveries each)."""
    deliveries = 4_000 if quick else 16_000
    runs = [asyncio.run(_deliver(deliveries)) for _ in range(3)]
    seen, wall, cpu = min(runs, key=lambda run: run[2])
    if seen != deliveries:
        raise RuntimeError(f"{seen} of {deliveries} deliveries reached the subscribers")
    return OutboxFigure(
        f"subscription delivery ({SUB_DOCS} subs, {FRAMES_PER_MESSAGE}/message)",
        seen,
        wall / seen * 1e6,
        cpu / seen * 1e6,
        "decode, parse, hand to the iterator, wake its task",
    )
