"""The SDK exports what the docs name, and its errors form one hierarchy."""

from __future__ import annotations

import cv_workspace_client
from cv_workspace_client import testing

DOCUMENTED = {
    "WorkspaceClient",
    "ClientConfig",
    "Commit",
    "Committed",
    "Subscription",
    "SyncStatus",
    "WorkspaceError",
    "OpRejectedError",
    "InvalidRequestError",
    "NotFoundError",
    "AuthError",
    "ForbiddenError",
    "StillPendingError",
    "ClientClosedError",
    "ConnectionFailedError",
    "ServerError",
    "RateLimitedError",
    "ProtocolError",
    "OutboxError",
    "OpDiscardedError",
    "TokenProvider",
    "LiveDoc",
}


def test_the_package_exports_the_documented_names() -> None:
    assert set(cv_workspace_client.__all__) >= DOCUMENTED
    for name in cv_workspace_client.__all__:
        assert hasattr(cv_workspace_client, name), name


def test_every_error_is_a_workspace_error_with_a_stable_code() -> None:
    errors = [
        getattr(cv_workspace_client, name)
        for name in cv_workspace_client.__all__
        if name.endswith("Error")
    ]
    assert errors
    for error in errors:
        assert issubclass(error, cv_workspace_client.WorkspaceError), error
    assert cv_workspace_client.OpRejectedError("node_exists", op_id="x" * 21).code == "node_exists"


def test_only_what_may_succeed_later_is_retryable() -> None:
    retryable = {
        name
        for name in cv_workspace_client.__all__
        if name.endswith("Error") and getattr(cv_workspace_client, name).retryable
    }
    assert retryable == {
        "ConnectionFailedError",
        "ServerError",
        "RateLimitedError",
        "ProtocolError",
    }


def test_the_testing_helpers_are_exported() -> None:
    assert set(testing.__all__) >= {"FaultProxy", "restart_client", "ProxyStats", "CutRule"}
