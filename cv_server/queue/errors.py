"""The work queue's exception hierarchy: one base class, one stable `code` per failure.

The HTTP routes map `code` to a problem+json answer; the SDK maps it back to the same types.
"""

from __future__ import annotations

from cv_server.errors import CvServerError

__all__ = [
    "IdempotencyKeyLost",
    "InvalidTransition",
    "LeaseLost",
    "NotCancellable",
    "NotDiscardable",
    "QueueError",
    "RequestCancelled",
    "RequestIdConflict",
    "RequestNotFound",
]


class QueueError(CvServerError):
    """Base of every queue error; `code` is stable and travels on the wire."""

    code: str = "queue_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class RequestNotFound(QueueError):
    """No request with that id (in that workspace)."""

    code = "not_found"


class LeaseLost(QueueError):
    """The caller's `claim_token` no longer holds the request: its lease lapsed and another worker
    claimed it, or the request already finished. The caller must stop the stage's writes — it can
    change nothing on the row (fenced by `claim_token`; River #1302)."""

    code = "lease_lost"


class InvalidTransition(QueueError):
    """The verb does not apply to the request's current status (e.g. replaying a row that is not
    poison)."""

    code = "invalid_transition"


class RequestIdConflict(QueueError):
    """A request id already names a request of another workspace: ids are never shared across
    tenants (deterministic ids hash the workspace in, so only a hand-made id can collide)."""

    code = "request_id_conflict"


class IdempotencyKeyLost(QueueError):
    """The owner's idempotency key is no longer in progress under its fingerprint (it was
    abandoned, or expired and taken over): the effect it was to describe is rolled back with it,
    and the client's retry starts afresh."""

    code = "idempotency_key_lost"


class RequestCancelled(QueueError):
    """Someone cancelled the request the caller holds: its heartbeat is refused with this. The
    holder must stop the stage and report back (`fail`), which finishes the row as `cancelled`;
    writes it already committed stay committed."""

    code = "cancelled"


class NotCancellable(QueueError):
    """The request already finished (done or poison): there is nothing left to cancel."""

    code = "not_cancellable"


class NotDiscardable(QueueError):
    """Only a poison request may be discarded by hand: a live one has a place in the queue or a
    worker (cancel it first), a done or cancelled one is deleted by the background pass after
    `request_retention_seconds` (docs/queue.md)."""

    code = "not_discardable"
