"""No confused deputy (docs/queue.md, "Whose grant a stage runs under"): a request records the
grant of the token that enqueued it, and a stage's writes for it are held to that grant by the
server, whatever the worker's own token allows. Real server on loopback, real worker."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from cv_mutations import NodeInsert
from cv_server.auth import mint_token
from cv_server.queue import deterministic_request_id
from cv_workspace_client import WorkspaceClient
from cv_workspace_client._queue import requester as api
from cv_workspace_client.stage import StageContext, StageRequest
from cv_workspace_client.worker import Worker, WorkerConfig
from cv_workspace_client.worker.parts import request_key
from tests.worker.conftest import (
    SECRET,
    WS,
    MakeServer,
    fast_client_config,
    open_client,
    running,
    url_of,
)

FAST = WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05)


def notes_only_token() -> str:
    return mint_token(SECRET, [WS], now=time.time(), scopes=["enqueue"], sub_docs=["notes*"])


async def write_to(ctx: StageContext) -> Any:
    """Write one node to the sub-doc the input names."""
    sub_doc = ctx.input["sub_doc"]
    await ctx.apply_op(sub_doc, NodeInsert(node_id="n1", parent_id="root"), key="n1")
    return {"wrote": sub_doc}


async def run_one(server: TestServer, enqueuer_token: str, sub_doc: str) -> api.RequestOutcome:
    async with (
        open_client(server) as worker_client,
        WorkspaceClient(
            url_of(server), token=enqueuer_token, config=fast_client_config()
        ) as enqueuer,
    ):
        worker = Worker(worker_client, {"write_to": write_to}, config=FAST)
        async with running(worker):
            answer = await api.enqueue(
                enqueuer, WS, {"stage": "write_to", "job_id": "J1", "input": {"sub_doc": sub_doc}}
            )
            return await api.wait_request(enqueuer, WS, answer.request_id, timeout=30)


async def nodes_of(server: TestServer, sub_doc: str) -> set[str]:
    async with open_client(server) as client:
        _, state = await client.get_state(WS, sub_doc)
    return set(state.nodes) - {"root"}


async def test_a_stage_enqueued_by_a_notes_only_token_is_refused_a_write_to_jobs(
    make_server: MakeServer,
) -> None:
    server = await make_server()
    outcome = await run_one(server, notes_only_token(), "jobs")
    assert outcome.status == "done"  # the refusal is the answer, not poison
    assert outcome.error["code"] == "forbidden_sub_doc"
    assert outcome.error["details"]["op"]["sub_doc"] == "jobs"
    assert await nodes_of(server, "jobs") == set()


async def test_a_stage_enqueued_by_a_notes_only_token_writes_inside_its_grant(
    make_server: MakeServer,
) -> None:
    server = await make_server()
    outcome = await run_one(server, notes_only_token(), "notes.a")
    assert outcome.status == "done"
    assert outcome.error is None
    assert outcome.result == {"wrote": "notes.a"}
    assert await nodes_of(server, "notes.a") == {"n1"}


async def test_the_same_stage_enqueued_by_a_full_token_writes_to_jobs(
    make_server: MakeServer,
) -> None:
    server = await make_server()
    full = mint_token(SECRET, [WS], now=time.time())
    outcome = await run_one(server, full, "jobs")
    assert outcome.status == "done"
    assert outcome.result == {"wrote": "jobs"}
    assert await nodes_of(server, "jobs") == {"n1"}


async def test_enqueues_of_one_job_under_different_grants_are_different_rows(
    make_server: MakeServer,
) -> None:
    server = await make_server()
    now = time.time()
    tokens = {
        "full": mint_token(SECRET, [WS], now=now),
        "notes": mint_token(SECRET, [WS], now=now, scopes=["enqueue"], sub_docs=["notes*"]),
        "notes_again": mint_token(
            SECRET, [WS], now=now + 1, scopes=["enqueue"], sub_docs=["notes*"]
        ),
        "jobs": mint_token(SECRET, [WS], now=now, scopes=["enqueue"], sub_docs=["jobs"]),
    }
    ids: dict[str, str] = {}
    for name, token in tokens.items():
        async with WorkspaceClient(url_of(server), token=token, config=fast_client_config()) as c:
            answer = await api.enqueue(c, WS, {"stage": "s", "job_id": "J1"})
            ids[name] = answer.request_id
    # A full token keeps the id it always had; one grant coalesces, two grants never do.
    assert ids["full"] == deterministic_request_id(WS, "J1", None, "s")
    assert ids["notes"] == ids["notes_again"]
    assert len({ids["full"], ids["notes"], ids["jobs"]}) == 3
    async with open_client(server) as client:
        row = await api.get_request(client, WS, ids["notes"])
    assert row.raw["enqueue_grant"] == {"scopes": ["enqueue"], "sub_docs": ["notes*"]}


async def test_the_stage_write_route_refuses_a_sub_doc_outside_the_recorded_grant(
    make_server: MakeServer,
) -> None:
    """The server's check, without the SDK: a worker holding the request (and a token that may
    write anywhere) is refused with the enqueuer's code; a stale claim token is `lease_lost`."""
    server = await make_server()
    async with WorkspaceClient(
        url_of(server), token=notes_only_token(), config=fast_client_config()
    ) as enqueuer:
        await api.enqueue(enqueuer, WS, {"stage": "s", "job_id": "J1"})
    worker_token = mint_token(SECRET, [WS], now=time.time(), scopes=["work"])
    headers = {"Authorization": f"Bearer {worker_token}"}
    op = {"ops": [NodeInsert(node_id="n1", parent_id="root").model_dump(mode="json")]}
    async with aiohttp.ClientSession(url_of(server), headers=headers) as http:
        async with http.post("/v1/queue/claim", json={"worker_classes": ["s"]}) as got:
            claimed = (await got.json())["request"]
        base = f"/v1/workspaces/{WS}/requests/{claimed['request_id']}/docs"
        token = {"Claim-Token": claimed["claim_token"]}
        async with http.post(f"{base}/jobs/ops", json=op, headers=token) as refused:
            assert refused.status == 403
            assert (await refused.json())["code"] == "forbidden_sub_doc"
        async with http.post(f"{base}/notes/ops", json=op, headers={"Claim-Token": "x"}) as stale:
            assert stale.status == 409
            assert (await stale.json())["code"] == "lease_lost"
        async with http.post(f"{base}/notes/ops", json=op, headers=token) as written:
            assert written.status == 200, await written.text()
            # `work` alone may write for the request it holds; not the op-log route itself.
        async with http.post(f"/v1/workspaces/{WS}/docs/notes/ops", json=op) as direct:
            assert direct.status == 403
            assert (await direct.json())["code"] == "missing_scope"


def test_the_cache_key_of_a_request_names_its_grant() -> None:
    row = {"request_id": "r", "workspace_id": WS, "stage": "s", "run": 1, "dequeue_count": 1}
    row |= {"created_at": 0.0, "input": {"a": 1}}
    full = StageRequest.from_row(row)
    notes = StageRequest.from_row(
        row | {"enqueue_grant": {"scopes": ["enqueue"], "sub_docs": ["notes*"]}}
    )
    jobs = StageRequest.from_row(
        row | {"enqueue_grant": {"scopes": ["enqueue"], "sub_docs": ["jobs"]}}
    )
    assert full.scope_key is None
    assert len({request_key(full), request_key(notes), request_key(jobs)}) == 3
