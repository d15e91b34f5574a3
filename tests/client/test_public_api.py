"""The SDK exports what its docs name, grouped (the client, errors, the queue, writing a stage,
the worker, providers), its errors form one hierarchy, and importing it loads the client alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import cv_workspace_client
from cv_workspace_client import providers, stage, testing, worker

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
    assert set(testing.__all__) >= {
        "FaultProxy",
        "restart_client",
        "ProxyStats",
        "CutRule",
        "CountingFakeProvider",
        "LocalServer",
        "LocalServerError",
    }
    assert issubclass(testing.LocalServerError, cv_workspace_client.WorkspaceError)


def test_test_fakes_live_under_testing_only() -> None:
    assert "CountingFakeProvider" not in cv_workspace_client.__all__
    assert "CountingFakeProvider" not in providers.__all__
    assert not hasattr(cv_workspace_client, "CountingFakeProvider")


#: What `import cv_workspace_client` must not load: the worker, its parts, the stage runtime,
#: the example stages, the providers, the CLI, the test helpers and the fakes behind them.
NOT_ON_IMPORT = (
    "cv_workspace_client.worker",
    "cv_workspace_client.worker.io",
    "cv_workspace_client.worker.parts",
    "cv_workspace_client._queue.holder",
    "cv_workspace_client.stage",
    "cv_workspace_client.stages",
    "cv_workspace_client.providers",
    "cv_workspace_client.cli",
    "cv_workspace_client.testing",
    "cv_workspace_client._fakes",
)


def test_importing_the_sdk_loads_none_of_the_worker_stages_providers_or_cli() -> None:
    code = (
        "import json, sys, cv_workspace_client; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('cv_workspace_client'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout))
    assert "cv_workspace_client.client" in loaded
    assert loaded.isdisjoint(NOT_ON_IMPORT), sorted(loaded & set(NOT_ON_IMPORT))


@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("Worker", worker),
        ("WorkerConfig", worker),
        ("WorkerStats", worker),
        ("Stage", stage),
        ("StageContext", stage),
        ("Handler", stage),
        ("StageRequest", stage),
        ("Provider", providers),
        ("OpenAICompatibleProvider", providers),
        ("ProviderError", providers),
    ],
)
def test_a_name_loaded_on_first_use_is_its_module_s_own(name: str, module: object) -> None:
    assert name in cv_workspace_client.__all__
    assert getattr(cv_workspace_client, name) is getattr(module, name)
    assert name in dir(cv_workspace_client)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = cv_workspace_client.no_such_name


def test_the_errors_stage_code_raises_are_the_sdk_s_own() -> None:
    # One hierarchy: the stage module re-exports the errors it steers the worker with.
    assert stage.ExpectedError is cv_workspace_client.ExpectedError
    assert stage.LeaseLostError is cv_workspace_client.LeaseLostError
    assert cv_workspace_client.LeaseLostError.__module__ == "cv_workspace_client.errors"
