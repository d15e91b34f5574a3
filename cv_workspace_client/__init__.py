"""cv_workspace_client: the retry-safe SDK apps install (docs/client.md).

```python
from cv_mutations import NodeMove
from cv_workspace_client import WorkspaceClient

async with WorkspaceClient(url, token=token, outbox="app.outbox.db") as client:
    commit = await client.apply_op("ws1", "tree", NodeMove(node_id="a", parent_id="b", index=0))
    clock, state = await client.get_state("ws1", "tree")
    async for committed in client.subscribe("ws1", "tree", since=clock): ...
```

Replay-test helpers for apps live in `cv_workspace_client.testing`.
"""

from cv_workspace_client._auth import TokenProvider
from cv_workspace_client._queue_api import QueueClient
from cv_workspace_client.client import WorkspaceClient
from cv_workspace_client.compute import ComputeResult, LockExpiringError, compute_once
from cv_workspace_client.config import ClientConfig
from cv_workspace_client.errors import (
    AuthError,
    ClientClosedError,
    ConnectionFailedError,
    ForbiddenError,
    InvalidRequestError,
    NotFoundError,
    OpDiscardedError,
    OpRejectedError,
    OutboxError,
    ProtocolError,
    RateLimitedError,
    ServerError,
    StillPendingError,
    WorkspaceError,
)
from cv_workspace_client.live import LiveDoc
from cv_workspace_client.models import Commit, Committed, SyncStatus
from cv_workspace_client.providers import (
    CountingFakeProvider,
    OpenAICompatibleProvider,
    Provider,
    ProviderError,
    ProviderRejected,
    ProviderResponseInvalid,
    ProviderResult,
    ProviderUnavailable,
)
from cv_workspace_client.queue_models import EnqueuedRequest, QueuedRequest, RequestOutcome
from cv_workspace_client.stage import (
    ExpectedError,
    Handler,
    LeaseLostError,
    RequestCancelledError,
    Stage,
    StageContext,
    StageRequest,
)
from cv_workspace_client.stream import Subscription
from cv_workspace_client.worker import Worker, WorkerConfig, WorkerStats

__all__ = [
    "AuthError",
    "ClientClosedError",
    "ClientConfig",
    "Commit",
    "Committed",
    "ComputeResult",
    "ConnectionFailedError",
    "CountingFakeProvider",
    "EnqueuedRequest",
    "ExpectedError",
    "ForbiddenError",
    "Handler",
    "InvalidRequestError",
    "LeaseLostError",
    "LiveDoc",
    "LockExpiringError",
    "NotFoundError",
    "OpDiscardedError",
    "OpRejectedError",
    "OpenAICompatibleProvider",
    "OutboxError",
    "ProtocolError",
    "Provider",
    "ProviderError",
    "ProviderRejected",
    "ProviderResponseInvalid",
    "ProviderResult",
    "ProviderUnavailable",
    "QueueClient",
    "QueuedRequest",
    "RateLimitedError",
    "RequestCancelledError",
    "RequestOutcome",
    "ServerError",
    "Stage",
    "StageContext",
    "StageRequest",
    "StillPendingError",
    "Subscription",
    "SyncStatus",
    "TokenProvider",
    "Worker",
    "WorkerConfig",
    "WorkerStats",
    "WorkspaceClient",
    "WorkspaceError",
    "compute_once",
]
