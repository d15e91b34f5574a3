"""`discard_pending`'s last step: make the deletion durable, then tell the discarded ops'
callers — or, if it cannot be made durable, tell them and the app so (`OutboxError`)."""

from __future__ import annotations

import asyncio

from cv_workspace_client._outbox.base import Outbox
from cv_workspace_client.errors import OutboxError, WorkspaceError
from cv_workspace_client.models import Commit

__all__ = ["retrieve", "settle_discard"]


async def settle_discard(
    outbox: Outbox,
    failed: list[BaseException],
    told: list[tuple[asyncio.Future[Commit], str, WorkspaceError]],
) -> None:
    """Wait until the `Discard` is durable, then tell the callers of the discarded ops; if
    it cannot be made so, tell them and the app's call so instead (`OutboxError`)."""
    error: BaseException | None = failed[0] if failed else None
    if error is None:
        try:
            await outbox.flush()
        except OutboxError as exc:
            error = exc
    if error is None:
        for future, _, discarded in told:
            if not future.done():
                future.set_exception(discarded)
        return
    code = error.code if isinstance(error, OutboxError) else "outbox_write_failed"
    reason = error.message if isinstance(error, WorkspaceError) else str(error)
    for future, op_id, _ in told:
        if not future.done():
            # Neither "discarded" (the row may come back after a restart) nor "pending"
            # (this client sends it no more).
            message = f"op {op_id} could not be discarded durably: {reason}"
            future.set_exception(OutboxError(code, message))
    raise OutboxError(code, f"the discard could not be made durable: {reason}")


def retrieve(task: asyncio.Future[None]) -> None:
    """Its outcome was the app's (`discard_pending`): asyncio must not log it as unretrieved
    when the app's call was cancelled."""
    if not task.cancelled():
        task.exception()
