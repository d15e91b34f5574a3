"""The PostgreSQL backend's curated exports resolve, and importing it needs no server."""

from __future__ import annotations

import subprocess
import sys

import cv_server.pg


def test_every_exported_name_of_the_postgres_backend_exists() -> None:
    assert len(cv_server.pg.__all__) == len(set(cv_server.pg.__all__))
    for name in cv_server.pg.__all__:
        assert hasattr(cv_server.pg, name), name
    assert {"PostgresOpLogStore", "Notifier", "migrate", "create_pool", "in_transaction"} <= set(
        cv_server.pg.__all__
    )


def test_the_postgres_error_codes_are_stable_strings() -> None:
    codes = {
        cls.code
        for cls in (
            cv_server.pg.PostgresBackendError,
            cv_server.pg.MigrationError,
            cv_server.pg.NotifyPayloadTooLarge,
        )
    }
    assert codes == {"postgres_error", "migration_failed", "notify_payload_too_large"}


def test_the_shipped_migrations_are_found_from_an_installed_import() -> None:
    code = "from cv_server.pg import load_migrations; print(len(load_migrations()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) >= 1
