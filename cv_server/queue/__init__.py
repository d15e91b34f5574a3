"""The durable work queue (layer 1, docs/queue.md): stage requests, leased claims, poison, plus the
idempotency keys of non-deterministic enqueues (docs/queue.md) and the result blob store
(docs/queue.md).

Backend-neutral names live here; the SQLite implementations are in `cv_server.sqlite.queue`,
`cv_server.sqlite.idempotency` and `cv_server.sqlite.blobs`.
"""

from cv_server.queue.blobs import BlobStore, new_blob_ref
from cv_server.queue.errors import (
    IdempotencyKeyLost,
    InvalidTransition,
    LeaseLost,
    NotCancellable,
    NotDiscardable,
    QueueError,
    RequestCancelled,
    RequestIdConflict,
    RequestNotFound,
)
from cv_server.queue.idempotency import (
    BeginOutcome,
    IdempotencyStore,
    InProgress,
    KeyCompletion,
    Mismatch,
    Owned,
    StoredAnswer,
    StoredResponse,
    grant_scoped_key,
    request_fingerprint,
)
from cv_server.queue.model import (
    FINISHED_STATUSES,
    LIVE_STATUSES,
    PURGED_STATUSES,
    STATUSES,
    CacheOutcome,
    ClaimAsk,
    Completion,
    EnqueueAsk,
    Enqueued,
    NewRequest,
    ProcessRequest,
    RequestEvent,
    RequestStatus,
    deterministic_request_id,
    random_request_id,
)
from cv_server.queue.store import Purged, QueueListener, QueueStore

__all__ = [
    "FINISHED_STATUSES",
    "LIVE_STATUSES",
    "PURGED_STATUSES",
    "STATUSES",
    "BeginOutcome",
    "BlobStore",
    "CacheOutcome",
    "ClaimAsk",
    "Completion",
    "EnqueueAsk",
    "Enqueued",
    "IdempotencyKeyLost",
    "IdempotencyStore",
    "InProgress",
    "InvalidTransition",
    "KeyCompletion",
    "LeaseLost",
    "Mismatch",
    "NewRequest",
    "NotCancellable",
    "NotDiscardable",
    "Owned",
    "ProcessRequest",
    "Purged",
    "QueueError",
    "QueueListener",
    "QueueStore",
    "RequestCancelled",
    "RequestEvent",
    "RequestIdConflict",
    "RequestNotFound",
    "RequestStatus",
    "StoredAnswer",
    "StoredResponse",
    "deterministic_request_id",
    "grant_scoped_key",
    "new_blob_ref",
    "random_request_id",
    "request_fingerprint",
]
