"""The pure rule of what ends a stage run with an answer and what with a retried failure."""

from __future__ import annotations

import pytest

from cv_workspace_client import (
    AuthError,
    ConnectionFailedError,
    ForbiddenError,
    InvalidRequestError,
    NotFoundError,
    OpRejectedError,
    RateLimitedError,
    ServerError,
    StillPendingError,
    WorkspaceError,
)
from cv_workspace_client.providers import ProviderRejected, ProviderUnavailable
from cv_workspace_client.stage import LeaseLostError, RequestCancelledError
from cv_workspace_client.worker.outcome import answer_payload, is_final_answer

# Pure: no file, socket or database (the `unit` cost mark; see tests/conftest.py).
pytestmark = pytest.mark.unit

ANSWERS = [
    OpRejectedError("node_not_found", "no node 'x'", op_id="op-1"),
    InvalidRequestError("invalid_field", "bad", status=422),
    NotFoundError("not_found", "gone", status=404),
    ForbiddenError("forbidden_workspace", "not yours"),
    ProviderRejected("refused", status=400),
    ProviderRejected("forbidden", status=403),
]
FAILURES = [
    ConnectionFailedError("connection_failed", "reset"),
    ServerError("internal", "boom", status=500),
    RateLimitedError("rate_limited", "slow down"),
    StillPendingError("op-1"),
    AuthError("unauthorized", "bad token"),
    ProviderRejected("bad key", status=401),
    ProviderRejected("too slow", status=408),
    ProviderUnavailable("down", status=503, attempts=3),
    LeaseLostError(),
    RequestCancelledError(),
    RuntimeError("a bug"),
]


@pytest.mark.parametrize("exc", ANSWERS, ids=lambda e: f"{type(e).__name__}")
def test_a_final_refusal_is_an_answer(exc: Exception) -> None:
    assert is_final_answer(exc)
    payload = answer_payload(exc)
    assert payload is not None
    assert isinstance(exc, WorkspaceError)
    assert payload["code"] == exc.code


@pytest.mark.parametrize("exc", FAILURES, ids=lambda e: f"{type(e).__name__}")
def test_a_transient_or_unexpected_error_is_a_failure_to_retry(exc: Exception) -> None:
    assert not is_final_answer(exc)
    assert answer_payload(exc) is None


def test_the_answer_to_a_refused_write_names_the_op() -> None:
    exc = OpRejectedError("node_not_found", "no node 'x'", op_id="op-1")
    write = {"key": "touch", "sub_doc": "tree", "type": "node.update", "op_id": "op-1"}
    payload = answer_payload(exc, write)
    assert payload is not None
    assert payload["code"] == "node_not_found"
    assert payload["details"] == {"op": write}
    assert "'touch'" in payload["message"]
    assert "node.update" in payload["message"]
