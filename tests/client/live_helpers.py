"""Shared waits for the `LiveDoc` tests: on the view's own change notifications, bounded."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from cv_mutations import SubDocState
from cv_workspace_client.live import LiveDoc

from .helpers import server_state

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
    await until(doc, lambda d: d.clock >= truth["clock"])
    return truth
