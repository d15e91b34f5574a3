"""Shared pieces of the `LiveDoc` tests: waits on the view's own change notifications
(bounded), and a view taken offline."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from cv_mutations import NodeInsert, SubDocState
from cv_workspace_client import WorkspaceClient
from cv_workspace_client.live import LiveDoc
from cv_workspace_client.testing import FaultProxy

from .helpers import WS, fast_config, server_state, token_for

BOUND = 20.0


def count_of(state: SubDocState, node: str = "n") -> Any:
    """Node `node`'s counter `c` (0 if unset), None if there is no such node."""
    found = state.nodes.get(node)
    return None if found is None else found.fields.get("c", 0)


async def until(doc: LiveDoc, condition: Callable[[LiveDoc], bool]) -> None:
    """Wait (bounded) for a state of the view, following its change notifications."""
    async with asyncio.timeout(BOUND):
        async for _ in doc.changes():
            if condition(doc):
                return
    raise AssertionError(f"the view stopped changing first ({doc.error!r})")


async def settled(doc: LiveDoc, url: str, token: str | None = None) -> dict[str, Any]:
    """Wait until the client has every op answered, the view holds nothing pending and is at
    the server's head; return the server's state of `tree`."""
    await doc.client.wait_synced(timeout=BOUND)
    await until(doc, lambda d: not d.pending)
    truth = await server_state(url, "tree", token=token)
    # The head exactly, not `>=`: a view opened from a kept state ahead of the server's log
    # (`initial=`) is past the head before it re-reads, and nothing commits after `truth`.
    await until(doc, lambda d: d.clock == truth["clock"])
    return truth


@dataclass
class Offline:
    """A view (`doc`) on a client (`mine`) whose every connection goes through `proxy`, now
    offline, and another client (`theirs`) straight to the server."""

    proxy: FaultProxy
    mine: WorkspaceClient
    theirs: WorkspaceClient
    doc: LiveDoc

    def back_online(self) -> None:
        self.proxy.refuse = False
        self.mine.retry_pending()  # (the reconnect would do it too)


@asynccontextmanager
async def offline_view(server_url: str) -> AsyncIterator[Offline]:
    """`tree` with node "n" inserted, its `LiveDoc` open, then the proxy refusing and every
    connection dropped (the websocket included): the app is offline. Two attempts per op."""
    async with FaultProxy(server_url) as proxy:
        config = fast_config(retry_attempts=2)
        async with (
            WorkspaceClient(proxy.url, token=token_for(WS), config=config) as mine,
            WorkspaceClient(server_url, token=token_for(WS), config=config) as theirs,
        ):
            await mine.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
            async with LiveDoc(mine, WS, "tree") as doc:
                proxy.refuse = True
                proxy.drop_all()
                yield Offline(proxy, mine, theirs, doc)


class Gate:
    """An injected `ClientConfig.sleep` that holds every retry delay (sends, reads, reconnects)
    until `open()`; afterwards delays pass at once. `entered` is set at each delay asked for."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self._opened = asyncio.Event()

    async def __call__(self, delay: float) -> None:
        self.entered.set()
        await self._opened.wait()

    def open(self) -> None:
        self._opened.set()


async def counts_seen(doc: LiveDoc, into: list[Any]) -> None:
    """Record node "n"'s counter at every version of the view (run as a task)."""
    async for state in doc.changes():
        into.append(count_of(state))
