"""Problem codes (docs/problems.md) map back to the SDK's typed errors (STYLE habit 8)."""

from __future__ import annotations

import pytest

from cv_workspace_client._io.http import parse_retry_after
from cv_workspace_client.errors import (
    AuthError,
    ForbiddenError,
    InvalidRequestError,
    NotFoundError,
    RateLimitedError,
    ServerError,
    WorkspaceError,
    error_from_problem,
)

# Pure: no file, socket or database (the `unit` cost mark; see tests/conftest.py).
pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (400, "malformed_json", InvalidRequestError),
        (413, "body_too_large", InvalidRequestError),
        (422, "too_many_ops", InvalidRequestError),
        (422, "unknown_op_type", InvalidRequestError),
        (422, "invalid_id", InvalidRequestError),
        (401, "unauthorized", AuthError),
        (403, "forbidden_workspace", ForbiddenError),
        (404, "not_found", NotFoundError),
        (429, "rate_limited", RateLimitedError),
        (500, "internal", ServerError),
        (503, "unavailable", ServerError),
        (None, "unauthorized", AuthError),  # a websocket error frame: no status, the code decides
        (None, "unavailable", ServerError),
    ],
)
def test_each_problem_code_maps_to_its_typed_error(
    status: int | None, code: str, expected: type[WorkspaceError]
) -> None:
    error = error_from_problem(status, {"code": code, "detail": "why"})
    assert type(error) is expected
    assert error.code == code
    assert error.message == "why"


def test_an_answer_without_a_problem_body_is_classified_by_its_status() -> None:
    assert isinstance(error_from_problem(502, None), ServerError)
    assert isinstance(error_from_problem(429, None), RateLimitedError)
    unknown = error_from_problem(418, None)
    assert isinstance(unknown, InvalidRequestError)
    assert unknown.code == "http_418"
    assert not unknown.retryable


def test_the_op_index_of_a_malformed_op_is_kept() -> None:
    error = error_from_problem(422, {"code": "invalid_field", "op_index": 3})
    assert isinstance(error, InvalidRequestError)
    assert error.op_index == 3


def test_retry_after_is_read_as_seconds_or_as_an_http_date() -> None:
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past
    assert parse_retry_after("soon") is None
    unavailable = error_from_problem(503, {"code": "unavailable"}, retry_after=30.0)
    assert isinstance(unavailable, ServerError)
    assert unavailable.retry_after == 30.0
    assert error_from_problem(500, {"code": "internal"}).retry_after is None
    limited = error_from_problem(429, {"code": "rate_limited"}, retry_after=4.0)
    assert isinstance(limited, RateLimitedError)
    assert limited.retry_after == 4.0
