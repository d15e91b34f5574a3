"""The documented public names are exported, and the pure cores import no I/O."""

from __future__ import annotations

import subprocess
import sys

import cv_mutations

DOCUMENTED_NAMES = {
    "OpIdEnvelope",
    "NodeInsert",
    "NodeMove",
    "NodeDelete",
    "NodeUpdate",
    "NodeIncrement",
    "Op",
    "parse_op",
    "SubDocState",
    "apply_op",
    "OpRejected",
    "new_op_id",
    "fingerprint",
}


def test_cv_mutations_exports_the_documented_names() -> None:
    assert set(cv_mutations.__all__) >= DOCUMENTED_NAMES
    for name in cv_mutations.__all__:
        assert hasattr(cv_mutations, name), name


def test_cv_mutations_imports_no_io_framework() -> None:
    code = (
        "import sys, cv_mutations; "
        "bad = [m for m in ('asyncio', 'aiohttp', 'websockets', 'sqlite3') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_cv_workspace_client_exports_the_documented_names() -> None:
    import cv_workspace_client

    documented = {
        "WorkspaceClient",
        "Commit",
        "Committed",
        "Worker",
        "ExpectedError",
        "Stage",
        "StageContext",
        "compute_once",
    }
    assert set(cv_workspace_client.__all__) >= documented
    for name in cv_workspace_client.__all__:
        assert hasattr(cv_workspace_client, name), name
    methods = ("apply_op", "apply_ops", "get_state", "subscribe", "pending_count", "wait_synced")
    for method in (*methods, "enqueue", "wait_request"):
        assert callable(getattr(cv_workspace_client.WorkspaceClient, method)), method


def test_cv_server_exports_the_documented_names() -> None:
    import cv_server

    assert set(cv_server.__all__) == {"ServerConfig", "create_app"}
