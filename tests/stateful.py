"""The one driver for Hypothesis state machines whose rules await: each machine owns a fresh event
loop, so one example's tasks, sockets and stores never reach the next, and every step runs to
completion (bounded by `step_timeout` where a step talks to a server) before Hypothesis picks the
next rule."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from hypothesis.stateful import RuleBasedStateMachine

__all__ = ["AsyncStateMachine"]

T = TypeVar("T")


class AsyncStateMachine(RuleBasedStateMachine):
    """A `RuleBasedStateMachine` with an event loop of its own: rules call `self.run(coro)`, and
    `teardown` ends with `self.close_loop()` once the machine's resources are released."""

    #: Seconds one `run` may take before it fails the example; None for no bound (pure steps).
    step_timeout: float | None = None

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Coroutine[Any, Any, T] | Awaitable[T]) -> T:
        """Run `coro` on the machine's loop to completion (within `step_timeout`)."""
        if self.step_timeout is not None:
            return self.loop.run_until_complete(asyncio.wait_for(coro, self.step_timeout))
        return self.loop.run_until_complete(coro)

    def close_loop(self) -> None:
        """Finish the loop's async generators and close it; the machine's last act."""
        try:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()
