"""What the end of a stage run means to the queue (docs/queue.md; docs/stages.md): an *answer*,
which completes the request with an error payload after one attempt, or a *failure*, which the
server retries (backoff, then poison at `max_dequeues`). Pure: no I/O.

An answer is anything the same run would meet again: an `ExpectedError` the handler raised, or
a final refusal by a downstream — the server refusing one of the stage's own writes
(`OpRejectedError` such as `node_not_found`, any 4xx `InvalidRequestError`, `ForbiddenError`), or
an LLM provider's 4xx (`ProviderRejected`). Retrying cannot change such an answer; it only burns
the request's attempts and parks it as poison. A failure is everything else: a lost connection,
a 5xx, a 408 or a 429, a write left unsettled, a bug in the handler. A refused credential (401,
the worker's token or its provider key) is a failure too: it says nothing of the request, and a
worker whose credentials work may run it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from cv_workspace_client.errors import (
    ForbiddenError,
    InvalidRequestError,
    OpRejectedError,
    WorkspaceError,
)
from cv_workspace_client.providers import ProviderRejected
from cv_workspace_client.stage import ExpectedError

__all__ = [
    "FINAL_ANSWERS",
    "answer_payload",
    "error_payload",
    "expected_payload",
    "is_final_answer",
]

#: The errors that are a downstream's final word: the run would meet the same one again.
FINAL_ANSWERS: Final = (OpRejectedError, InvalidRequestError, ForbiddenError, ProviderRejected)
#: A provider's 4xx that says nothing of the request: its key (401), or its patience (408).
_PROVIDER_TRANSIENT: Final = frozenset({401, 408})
#: Longest message kept in a payload.
_MESSAGE_CHARS: Final = 2000


def is_final_answer(exc: BaseException) -> bool:
    """True if `exc` ends the run with an answer (see the module docstring), not a failure."""
    if isinstance(exc, ProviderRejected):
        return exc.status not in _PROVIDER_TRANSIENT
    return isinstance(exc, FINAL_ANSWERS)


def answer_payload(
    exc: BaseException, write: Mapping[str, Any] | None = None
) -> dict[str, Any] | None:
    """The error payload a final answer completes the request with, or None for a failure.

    `write` describes the stage's own write the server refused (`StageContext.refused_write`):
    the payload then names that op (`details.op`) with the refusal's code, so whoever reads the
    request learns which write was refused and why.
    """
    if not is_final_answer(exc):
        return None
    assert isinstance(exc, WorkspaceError)
    details: dict[str, Any] = {}
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        details["status"] = status
    message = exc.message or str(exc)
    if write is not None:
        details["op"] = dict(write)
        message = (
            f"the stage's write {write.get('key')!r} ({write.get('type')} to "
            f"{write.get('sub_doc')!r}, op_id {write.get('op_id')}) was refused: {exc.code}: "
            f"{exc.message}"
        )
    return {"code": exc.code, "message": message[:_MESSAGE_CHARS], "details": details or None}


def expected_payload(exc: ExpectedError) -> dict[str, Any]:
    """The error payload of an expected error, in a form JSON can carry.

    An expected error is an answer, never retried. Details with no JSON form (a set,
    NaN, an object) would otherwise fail the completion as `invalid_result` and turn the answer
    into retries ending in poison; they travel as their `repr` instead.
    """
    payload = exc.payload()
    try:
        json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError):
        payload = {
            "code": str(exc.code),
            "message": str(exc.message),
            "details": repr(exc.details)[:_MESSAGE_CHARS],
        }
    return payload


def error_payload(exc: BaseException) -> dict[str, Any]:
    """The error a failure is reported with (kept on the row for diagnosis)."""
    code = exc.code if isinstance(exc, WorkspaceError) else type(exc).__name__
    return {"code": code, "message": str(exc)[:_MESSAGE_CHARS]}
