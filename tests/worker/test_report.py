"""What a stage's end means to the queue (docs/queue.md): a big result completes through the blob
store on its first attempt, one past `max_result_bytes` and a stage write the server refuses for
good complete at once with an error payload, and transient failures stay retryable — with real
`cv-worker` processes (and the real `Worker`) against a real server on loopback."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from cv_mutations import NodeInsert
from cv_server.cli import parse_overrides
from cv_workspace_client import (
    ConnectionFailedError,
    QueueClient,
    RateLimitedError,
    ServerError,
)
from cv_workspace_client.errors import error_from_problem
from cv_workspace_client.providers import ProviderRejected
from cv_workspace_client.stage import StageContext
from cv_workspace_client.worker import Worker, WorkerConfig
from tests.worker.conftest import WS, MakeServer, open_client, running, token_for, url_of

FAST = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05)
#: Several MB: far past the server's 1 MiB body limit, which every completion body keeps.
BIG = 3_000_000
WAIT = 60.0


@asynccontextmanager
async def cv_worker(server: TestServer, worker_id: str) -> AsyncIterator[None]:
    """A real `cv-worker` process running `tests.worker.answer_stages`; SIGTERM at the end."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cv_workspace_client.cli", "worker",
        "--url", url_of(server), "--token", token_for(WS),
        "--stages", "tests.worker.answer_stages:STAGES", "--worker-id", worker_id,
        "--log-level", "WARNING",
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        ready = await asyncio.wait_for(proc.stdout.readline(), WAIT)
        assert ready.decode().startswith(f"cv-worker {worker_id} ready")
        yield
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), WAIT) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _blob(server: TestServer, ref: str) -> bytes:
    url = f"{url_of(server)}/v1/workspaces/{WS}/blobs/{ref}"
    async with (
        aiohttp.ClientSession() as session,
        session.get(url, headers={"Authorization": f"Bearer {token_for(WS)}"}) as response,
    ):
        assert response.status == 200
        return await response.read()


# -- item: results of several MB ------------------------------------------------------------------


async def test_a_result_of_several_megabytes_completes_on_its_first_attempt_byte_for_byte(
    make_server: MakeServer,
) -> None:
    # No backoff: a completion refused for its size would be retried at once, to poison.
    server = await make_server(failure_backoff_seconds=0.0)
    async with cv_worker(server, "big-worker"), QueueClient(url_of(server), token_for(WS)) as qc:
        enqueued = await qc.enqueue(WS, stage="big", job_id="J1", input=BIG)
        outcome = await qc.wait_request(WS, enqueued.request_id, timeout=WAIT)
    assert outcome.status == "done", outcome.error
    assert outcome.error is None
    assert outcome.result == "x" * BIG
    row = outcome.request
    assert row is not None
    assert row.dequeue_count == 1  # its first attempt
    assert row.blob_ref is not None
    assert row.result is None  # the row keeps the reference, the blob store the bytes
    assert await _blob(server, row.blob_ref) == json.dumps("x" * BIG).encode()


async def test_a_result_past_max_result_bytes_completes_at_once_with_result_too_large(
    make_server: MakeServer,
) -> None:
    assert parse_overrides(["max_result_bytes=1500000"]) == {"max_result_bytes": 1_500_000}
    server = await make_server(failure_backoff_seconds=0.0, max_result_bytes=1_500_000)
    async with cv_worker(server, "too-big"), QueueClient(url_of(server), token_for(WS)) as qc:
        enqueued = await qc.enqueue(WS, stage="big", job_id="J1", input=2_000_000)
        fits = await qc.enqueue(WS, stage="big", job_id="J2", input=1_200_000)
        outcome = await qc.wait_request(WS, enqueued.request_id, timeout=WAIT)
        fitting = await qc.wait_request(WS, fits.request_id, timeout=WAIT)
    assert outcome.status == "done"
    assert outcome.error is not None
    assert outcome.error["code"] == "result_too_large"
    assert outcome.error["details"] == {"bytes": 2_000_002}
    assert outcome.request is not None
    assert outcome.request.dequeue_count == 1  # never retried
    assert fitting.status == "done"
    assert fitting.result == "x" * 1_200_000


async def test_the_result_upload_is_fenced_and_refuses_what_is_not_json(
    make_server: MakeServer,
) -> None:
    server = await make_server(max_result_bytes=1000)
    url = f"{url_of(server)}/v1/workspaces/{WS}/requests"
    auth = {"Authorization": f"Bearer {token_for(WS)}"}
    # One connection per request: the server closes one whose refused body it did not read.
    fresh = aiohttp.TCPConnector(force_close=True)
    async with (
        QueueClient(url_of(server), token_for(WS)) as qc,
        aiohttp.ClientSession(connector=fresh) as http,
    ):
        enqueued = await qc.enqueue(WS, stage="s", job_id="J1")
        async with http.post(
            f"{url_of(server)}/v1/queue/claim", json={"worker_classes": ["s"]}, headers=auth
        ) as response:
            token = (await response.json())["request"]["claim_token"]
        upload = f"{url}/{enqueued.request_id}/result"
        cases = [
            ({"Claim-Token": "not-the-token"}, b'"x"', 409, "lease_lost"),
            ({"Claim-Token": token}, b"not json", 400, "malformed_json"),
            ({"Claim-Token": token}, b'"' + b"x" * 2000 + b'"', 413, "result_too_large"),
            ({}, b'"x"', 422, "invalid_field"),
            (
                {"Claim-Token": token, "Content-Encoding": "gzip"},
                b"not gzip",
                400,
                "malformed_body",
            ),
            (
                {"Claim-Token": token, "Content-Encoding": "br"},
                b'"x"',
                415,
                "unsupported_content_encoding",
            ),
            # Bounded once decoded: a small compressed body past the limit is refused too.
            (
                {"Claim-Token": token, "Content-Encoding": "gzip"},
                gzip.compress(b'"' + b"x" * 5000 + b'"'),
                413,
                "result_too_large",
            ),
        ]
        json_body = {"Content-Type": "application/json"}
        for headers, body, status, code in cases:
            async with http.post(
                upload, data=body, headers={**auth, **json_body, **headers}
            ) as response:
                problem = await response.json(content_type=None)
                assert (response.status, problem["code"]) == (status, code), problem
        async with http.post(
            upload, data=b'{"ok":true}', headers={**auth, **json_body, "Claim-Token": token}
        ) as response:
            assert response.status == 201
            stored = await response.json()
        complete = f"{url}/{enqueued.request_id}/complete"
        bogus = {"claim_token": token, "blob_ref": "b_" + "0" * 40}
        async with http.post(complete, json=bogus, headers=auth) as response:
            assert (response.status, (await response.json())["code"]) == (422, "invalid_field")
        named = {"claim_token": token, "blob_ref": stored["blob_ref"]}
        async with http.post(complete, json=named, headers=auth) as response:
            assert response.status == 200
        outcome = await qc.wait_request(WS, enqueued.request_id, timeout=WAIT)
    assert (outcome.status, outcome.result) == ("done", {"ok": True})
    assert stored["bytes"] == len(b'{"ok":true}')


# -- item: a stage's own write refused for good ---------------------------------------------------


async def test_a_stage_write_refused_for_good_completes_naming_the_op_after_one_attempt(
    make_server: MakeServer,
) -> None:
    server = await make_server(failure_backoff_seconds=0.0)
    async with cv_worker(server, "refused"), QueueClient(url_of(server), token_for(WS)) as qc:
        enqueued = await qc.enqueue(WS, stage="refused_write", job_id="J1")
        outcome = await qc.wait_request(WS, enqueued.request_id, timeout=WAIT)
    assert outcome.status == "done"
    assert outcome.request is not None
    assert outcome.request.dequeue_count == 1
    error = outcome.error
    assert error is not None
    assert error["code"] == "node_not_found"
    op = error["details"]["op"]
    assert (op["key"], op["sub_doc"], op["type"]) == ("touch-missing", "tree", "node.update")
    assert op["op_id"]
    assert "touch-missing" in error["message"]


async def test_a_downstream_4xx_is_an_answer_and_a_transient_failure_is_retried(
    make_server: MakeServer,
) -> None:
    server = await make_server(failure_backoff_seconds=0.0)
    attempts: dict[str, int] = {}

    async def rejected(ctx: StageContext) -> Any:
        attempts["rejected"] = attempts.get("rejected", 0) + 1
        raise ProviderRejected("the model refused the prompt", status=400)

    transient = [
        ServerError("unavailable", "down for a moment", status=503),
        RateLimitedError("rate_limited", "slow down"),
        ConnectionFailedError("connection_failed", "reset"),
    ]

    async def flaky(ctx: StageContext) -> Any:
        attempts["flaky"] = attempts.get("flaky", 0) + 1
        if ctx.request.dequeue_count <= len(transient):
            raise transient[ctx.request.dequeue_count - 1]
        await ctx.apply_op("tree", NodeInsert(node_id="made", parent_id="root"), key="make")
        return "made it"

    async with open_client(server) as client:
        worker = Worker(client, {"rejected": rejected, "flaky": flaky}, config=FAST)
        async with running(worker):
            one = await client.enqueue(WS, stage="rejected", job_id="J1")
            two = await client.enqueue(WS, stage="flaky", job_id="J2", max_dequeues=5)
            answered = await client.wait_request(WS, one.request_id, WAIT)
            retried = await client.wait_request(WS, two.request_id, WAIT)
    assert answered.status == "done"
    assert answered.error is not None
    assert (answered.error["code"], answered.error["details"]) == (
        "provider_rejected",
        {"status": 400},
    )
    assert attempts["rejected"] == 1
    assert retried.status == "done"
    assert retried.result == "made it"
    assert attempts["flaky"] == 4
    assert retried.request is not None
    assert retried.request.dequeue_count == 4


def test_a_408_is_retried_like_a_timeout_and_other_4xx_are_final() -> None:
    assert error_from_problem(408, None).retryable
    assert error_from_problem(429, None).retryable
    assert not error_from_problem(409, {"code": "node_not_found"}).retryable
    assert not error_from_problem(400, None).retryable
