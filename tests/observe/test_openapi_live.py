"""schemathesis against the live server, from its own `/openapi.json`: for every operation, a
bounded number of generated requests (valid and invalid) with a valid token; no answer is a 5xx,
and every answer conforms to the document (status, content type, headers, body schema).

The server is the real `cv-server serve` process on a loopback port (SQLite).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.result import Ok

from tests.acceptance.procs import create_sqlite_database, free_port, mint_cli_token

pytestmark = pytest.mark.acceptance

REPO = Path(__file__).resolve().parents[2]
#: Generated requests per operation and mode: ~25 operations, two modes (valid and invalid
#: data), so about 500 requests in all, well within a minute on a loaded machine.
EXAMPLES = 10
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    tmp = tmp_path_factory.mktemp("schemathesis")
    db = tmp / "cv.db"
    create_sqlite_database(db)
    token = mint_cli_token(db, "*")
    port = free_port()
    with (tmp / "server.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cv_server.cli", "serve", "--db", str(db), "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until it listens (or exits)
    assert "listening on" in line, line
    try:
        yield f"http://127.0.0.1:{port}", token
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        proc.stdout.close()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_the_live_server_answers_every_generated_request_as_documented(
    live_server: tuple[str, str], mode: GenerationMode
) -> None:
    url, token = live_server
    api = schemathesis.openapi.from_url(f"{url}/openapi.json")
    headers = {"Authorization": f"Bearer {token}"}
    operations = []
    for result in api.get_all_operations():
        assert isinstance(result, Ok), result.err()  # the document is one schemathesis reads
        operations.append(result.ok())
    assert len(operations) >= 20

    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def run(case: Case[Any]) -> None:
            case.call_and_validate(base_url=url, headers=headers, checks=CHECKS, timeout=30)

        try:
            run()
        except Unsatisfiable:  # nothing to send that breaks the document (no parameters)
            assert mode is GenerationMode.NEGATIVE, operation.label
            continue
        except Exception as exc:
            raise AssertionError(f"{operation.label} ({mode.value}): {exc}") from exc
