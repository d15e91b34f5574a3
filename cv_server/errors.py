"""The server's exceptions: every one it raises on purpose is a `CvServerError`.

One root, so an embedding app or a test can catch "anything the server decided" apart from a
bug. Each subclass lives beside the code that raises it; this module is a leaf that imports
nothing, so every module can use the root without an import cycle. The tree:

    CvServerError
    ├── Problem                      cv_server.http.problems: an answer, sent as problem+json
    ├── TokenError                   cv_server.auth: a bearer token that cannot be honoured
    ├── OpLogCorrupted               cv_server.oplog: a stored log that cannot be rebuilt
    ├── QueueError                   cv_server.queue: a queue verb's refusal, with its `code`
    │   ├── RequestNotFound
    │   ├── LeaseLost
    │   ├── InvalidTransition
    │   ├── RequestIdConflict
    │   ├── IdempotencyKeyLost
    │   ├── RequestCancelled
    │   ├── NotCancellable
    │   └── NotDiscardable
    ├── ScheduleError                cv_server.schedules.store: a schedule verb's refusal
    │   ├── ScheduleExists
    │   └── ScheduleNotFound
    ├── DatabaseUnusable             cv_server.stores: this process cannot serve the database
    │   ├── MigrationError           (also a PostgresBackendError)
    │   ├── PostgresRefused          (also a PostgresBackendError)
    │   ├── SchemaMissing            (also a PostgresBackendError)
    │   └── NotSetUp                 (also a PostgresBackendError)
    ├── StorageUnavailable           cv_server.storage_faults: a write the storage refused
    ├── ChannelRefusal               cv_server.channel: a worker-channel frame refused whole
    └── PostgresBackendError         cv_server.pg.errors: the PostgreSQL backend's own
        └── NotifyPayloadTooLarge

`tests/server/test_errors.py` fails on an exception class of the server outside this tree.
"""

from __future__ import annotations

__all__ = ["CvServerError"]


class CvServerError(Exception):
    """The root of every exception the server raises on purpose (see the tree above)."""
