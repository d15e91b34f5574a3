"""cv_workspace_client: the retry-safe SDK apps install (docs/client.md).

```python
from cv_mutations import NodeMove
from cv_workspace_client import WorkspaceClient

async with WorkspaceClient(url, token=token, outbox="app.outbox.db") as client:
    commit = await client.apply_op("ws1", "tree", NodeMove(node_id="a", parent_id="b", index=0))
    clock, state = await client.get_state("ws1", "tree")
    async for committed in client.subscribe("ws1", "tree", since=clock): ...
```

The names below are grouped as in `__all__`: the client and its values, its errors, the work
queue, writing a stage, the worker that runs stages, and the providers a stage calls. The
worker, the stage runtime and the providers load on first use (`import cv_workspace_client`
loads the client alone); `cv_workspace_client.worker` and the other modules import as usual.
Test helpers for apps (`FaultProxy`, `restart_client`, `CountingFakeProvider`) live in
`cv_workspace_client.testing`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cv_workspace_client._core.conflicts import ConflictRetryPolicy
from cv_workspace_client._core.reconnect import ReconnectPolicy
from cv_workspace_client._io.auth import TokenProvider
from cv_workspace_client._queue.requester import QueueClient
from cv_workspace_client.client import WorkspaceClient
from cv_workspace_client.compute import ComputeResult, LockExpiringError, compute_once
from cv_workspace_client.config import ClientConfig
from cv_workspace_client.errors import (
    AuthError,
    ClientClosedError,
    ConnectionFailedError,
    ExpectedError,
    ForbiddenError,
    InvalidRequestError,
    LeaseLostError,
    LogCompactedError,
    NotFoundError,
    OpDiscardedError,
    OpRejectedError,
    OutboxError,
    ProtocolError,
    RateLimitedError,
    RequestCancelledError,
    ServerError,
    StillPendingError,
    VersionConflictError,
    WorkspaceError,
)
from cv_workspace_client.live import LiveDoc
from cv_workspace_client.models import Commit, Committed, Snapshot, SyncStatus
from cv_workspace_client.queue_models import (
    AppliedAndEnqueued,
    EnqueuedRequest,
    EnqueueItem,
    QueuedRequest,
    RequestOutcome,
)
from cv_workspace_client.schedule_models import Schedule
from cv_workspace_client.stream import Subscription

if TYPE_CHECKING:
    from cv_workspace_client.providers import (
        OpenAICompatibleProvider,
        Provider,
        ProviderError,
        ProviderRejected,
        ProviderResponseInvalid,
        ProviderResult,
        ProviderUnavailable,
    )
    from cv_workspace_client.stage import Handler, Stage, StageContext, StageRequest
    from cv_workspace_client.worker import Worker, WorkerConfig, WorkerStats

# the client, its configuration and what it hands back
__all__ = [
    "ClientConfig",
    "Commit",
    "Committed",
    "ConflictRetryPolicy",
    "LiveDoc",
    "ReconnectPolicy",
    "Snapshot",
    "Subscription",
    "SyncStatus",
    "TokenProvider",
    "WorkspaceClient",
]
# errors: one hierarchy, each with a stable `code`
__all__ += [
    "AuthError",
    "ClientClosedError",
    "ConnectionFailedError",
    "ExpectedError",
    "ForbiddenError",
    "InvalidRequestError",
    "LeaseLostError",
    "LockExpiringError",
    "LogCompactedError",
    "NotFoundError",
    "OpDiscardedError",
    "OpRejectedError",
    "OutboxError",
    "ProtocolError",
    "RateLimitedError",
    "RequestCancelledError",
    "ServerError",
    "StillPendingError",
    "VersionConflictError",
    "WorkspaceError",
]
# the work queue and the compute lock, from an app
__all__ += [
    "AppliedAndEnqueued",
    "ComputeResult",
    "EnqueueItem",
    "EnqueuedRequest",
    "QueueClient",
    "QueuedRequest",
    "RequestOutcome",
    "Schedule",
    "compute_once",
]
# writing a stage (loaded on first use)
__all__ += [
    "Handler",
    "Stage",
    "StageContext",
    "StageRequest",
]
# the worker that runs stages (loaded on first use)
__all__ += [
    "Worker",
    "WorkerConfig",
    "WorkerStats",
]
# providers a stage calls (loaded on first use)
__all__ += [
    "OpenAICompatibleProvider",
    "Provider",
    "ProviderError",
    "ProviderRejected",
    "ProviderResponseInvalid",
    "ProviderResult",
    "ProviderUnavailable",
]

#: The names that load their module on first use, and where each lives.
_LAZY: dict[str, str] = {
    **dict.fromkeys(("Handler", "Stage", "StageContext", "StageRequest"), "stage"),
    **dict.fromkeys(("Worker", "WorkerConfig", "WorkerStats"), "worker"),
    **dict.fromkeys(
        (
            "OpenAICompatibleProvider",
            "Provider",
            "ProviderError",
            "ProviderRejected",
            "ProviderResponseInvalid",
            "ProviderResult",
            "ProviderUnavailable",
        ),
        "providers",
    ),
}


def __getattr__(name: str) -> Any:
    """Load a stage, worker or provider name from its module on first access (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
