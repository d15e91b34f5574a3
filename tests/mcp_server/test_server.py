"""The MCP tools (`cv_workspace_client.mcp_server`, docs/mcp.md) in process: the `mcp` SDK's
client connected to the server object, over a `WorkspaceClient` on the real server on loopback.
The subprocess and transport paths are `tests/acceptance/test_mcp_server.py`'s."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from mcp import Client, MCPError
from mcp_types import INVALID_PARAMS
from pydantic import ValidationError

from cv_mutations import NodeInsert
from cv_workspace_client import ForbiddenError, StillPendingError, WorkspaceClient
from cv_workspace_client.mcp_server import build_server
from cv_workspace_client.mcp_server.answers import arguments_error, workspace_error
from cv_workspace_client.mcp_server.feeds import ResourceFeeds, doc_uri, parse_doc_uri
from tests.client.helpers import WS


@contextlib.asynccontextmanager
async def in_process(server_url: str, token: str) -> AsyncIterator[tuple[Client, ResourceFeeds]]:
    """Entered in the test's own task: anyio's cancel scopes (the `mcp` client's) must be left
    in the task that entered them, which an async fixture's teardown is not."""
    async with WorkspaceClient(server_url, token=token) as sdk:
        server, feeds = build_server(sdk)
        try:
            async with Client(server) as client:
                yield client, feeds
        finally:
            await feeds.close()


async def call(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, result.content
    answer: dict[str, Any] | None = result.structured_content
    assert answer is not None
    return answer


def test_importing_the_sdk_and_its_cli_does_not_import_mcp() -> None:
    code = (
        "import sys, cv_workspace_client, cv_workspace_client.cli; "
        "print([m for m in ('mcp', 'mcp_types', 'uvicorn', 'cv_workspace_client.mcp_server') "
        "if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


def test_a_still_pending_op_is_reported_under_the_code_that_stopped_it() -> None:
    refusal = ForbiddenError("forbidden_workspace", "the token does not grant 'x'")
    result = workspace_error(StillPendingError("op_1234567", refusal), op_ids=["op_1234567"])

    assert result.is_error
    error = json.loads(result.content[0].text)["error"]  # type: ignore[union-attr]
    assert error["code"] == "forbidden_workspace"
    assert error["pending"] is True
    assert error["op_ids"] == ["op_1234567"]
    assert "op_1234567" in error["message"]


def test_an_op_that_does_not_parse_is_answered_with_the_op_logs_code() -> None:
    ops = [{"type": "node.insert", "node_id": "a", "parent_id": "root"}, {"type": "node.nope"}]
    try:
        NodeInsert.model_validate({"type": "node.nope"})
    except ValidationError as exc:
        result = arguments_error("apply_ops", {"ops": ops}, exc)
    error = json.loads(result.content[0].text)["error"]  # type: ignore[union-attr]
    assert error["code"] == "unknown_op_type"
    assert error["message"].startswith("ops[1]: ")


def test_sub_doc_uris_round_trip_and_others_are_not_sub_docs() -> None:
    assert parse_doc_uri(doc_uri("ws-1", "jobs")) == ("ws-1", "jobs")
    assert parse_doc_uri("cv://ws-1/docs/") is None
    assert parse_doc_uri("cv://ws-1/other/jobs") is None
    assert parse_doc_uri("file:///etc/passwd") is None


async def test_an_op_id_the_caller_gives_is_kept_and_answered(server_url: str, token: str) -> None:
    async with in_process(server_url, token) as (client, _):
        op = {"type": "node.insert", "node_id": "a", "parent_id": "root", "op_id": "agent-op-0001"}
        first = await call(client, "apply_ops", workspace_id=WS, sub_doc="tree", ops=[op])
        again = await call(client, "apply_ops", workspace_id=WS, sub_doc="tree", ops=[op])

    assert first["op_ids"] == again["op_ids"] == ["agent-op-0001"]
    assert first["results"][0]["duplicate"] is False
    assert again["results"][0]["duplicate"] is True


async def test_an_atomic_call_with_a_rejected_op_commits_none(server_url: str, token: str) -> None:
    async with in_process(server_url, token) as (client, _):
        ops = [
            {"type": "node.insert", "node_id": "kept-out", "parent_id": "root"},
            {"type": "node.delete", "node_id": "missing"},
        ]
        answer = await call(
            client, "apply_ops", workspace_id=WS, sub_doc="tree", ops=ops, atomic=True
        )
        state = await call(client, "get_state", workspace_id=WS, sub_doc="tree")

    assert [r["status"] for r in answer["results"]] == ["rejected", "rejected"]
    assert {r["code"] for r in answer["results"]} == {"atomic_aborted", "node_not_found"}
    assert "kept-out" not in state["state"]["nodes"]
    assert state["clock"] == 0


async def test_a_listen_stream_runs_one_feed_per_sub_doc_while_it_lasts(
    server_url: str, token: str
) -> None:
    async with in_process(server_url, token) as (client, feeds):
        uri = doc_uri(WS, "tree")
        async with client.listen(resource_subscriptions=[uri, uri, "cv://elsewhere/x"]) as events:
            assert feeds.uris == {uri}  # the other URI is no sub-doc: nothing follows it
            await call(
                client, "apply_ops", workspace_id=WS, sub_doc="tree",
                ops=[{"type": "node.insert", "node_id": "n", "parent_id": "root"}],
            )  # fmt: skip
            async with asyncio.timeout(30):
                event = await anext(aiter(events))
        assert event.uri == uri  # type: ignore[union-attr]


async def test_an_enqueue_retried_under_its_idempotency_key_answers_the_first_request(
    server_url: str, token: str
) -> None:
    async with in_process(server_url, token) as (client, _):
        args: dict[str, Any] = {"workspace_id": WS, "stage": "unserved", "input": {"n": 1}}
        first = await call(client, "enqueue", **args, idempotency_key="agent-key-1")
        retried = await call(client, "enqueue", **args, idempotency_key="agent-key-1")
        other = await call(client, "enqueue", **args)

    assert retried["request_id"] == first["request_id"]
    assert first["replayed"] is False
    assert retried["replayed"] is True
    assert other["request_id"] != first["request_id"]  # no job_id, no key: a new request


async def test_a_sub_doc_the_token_does_not_grant_is_an_invalid_params_error(
    server_url: str, token: str
) -> None:
    async with in_process(server_url, token) as (client, _):
        with pytest.raises(MCPError) as refused:
            await client.read_resource(doc_uri("elsewhere", "tree"))

    assert refused.value.error.code == INVALID_PARAMS
    assert "forbidden_workspace" in refused.value.error.message


@pytest.mark.filterwarnings("ignore::mcp.MCPDeprecationWarning")
async def test_a_handshake_era_subscription_runs_a_feed_until_unsubscribed(
    server_url: str, token: str
) -> None:
    async with WorkspaceClient(server_url, token=token) as sdk:
        server, feeds = build_server(sdk)
        try:
            async with Client(server, mode="legacy") as client:
                with pytest.raises(MCPError) as refused:
                    await client.subscribe_resource("file:///etc/passwd")
                await client.subscribe_resource(doc_uri(WS, "tree"))
                followed = feeds.uris
                await client.unsubscribe_resource(doc_uri(WS, "tree"))
                after = feeds.uris
        finally:
            await feeds.close()

    assert refused.value.error.code == INVALID_PARAMS
    assert followed == {doc_uri(WS, "tree")}
    assert after == frozenset()  # the last subscriber gone: the SDK subscription ends


async def test_a_result_past_the_row_comes_back_whole_from_the_blob_store(
    server_url: str, token: str
) -> None:
    # 2,000,000 characters: past what a row holds, stored as a blob; both tools fetch it.
    size = 2_000_000
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cv_workspace_client.cli", "worker",
        "--url", server_url, "--token", token,
        "--stages", "tests.worker.answer_stages:STAGES", "--log-level", "WARNING",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert worker.stdout is not None
        ready = await asyncio.wait_for(worker.stdout.readline(), 60)
        assert b"ready" in ready
        async with in_process(server_url, token) as (client, _):
            enqueued = await call(client, "enqueue", workspace_id=WS, stage="big", input=size)
            waited = await call(
                client, "wait_request", workspace_id=WS, request_id=enqueued["request_id"]
            )
            shown = await call(
                client, "get_request", workspace_id=WS, request_id=enqueued["request_id"]
            )
    finally:
        worker.kill()
        await worker.wait()

    assert waited["status"] == "done"
    assert waited["result"] == "x" * size
    assert shown["result"] == "x" * size
    assert shown["request"]["blob_ref"]  # it did go through the blob store


async def test_apply_ops_based_on_a_stale_clock_is_a_version_conflict_naming_the_head(
    server_url: str, token: str
) -> None:
    async with in_process(server_url, token) as (client, _):
        ops = [{"type": "node.insert", "node_id": "a", "parent_id": "root"}]
        first = await call(
            client, "apply_ops", workspace_id=WS, sub_doc="tree", ops=ops, if_clock=0
        )
        assert first["results"][0]["clock"] == 1
        ops = [{"type": "node.insert", "node_id": "b", "parent_id": "root"}]
        result = await client.call_tool(
            "apply_ops", {"workspace_id": WS, "sub_doc": "tree", "ops": ops, "if_clock": 0}
        )
        assert result.is_error
        (block,) = result.content
        error = json.loads(block.text)["error"]  # type: ignore[union-attr]
        assert (error["code"], error["clock"]) == ("version_conflict", 1)
        assert len(error["op_ids"]) == 1
        state = await call(client, "get_state", workspace_id=WS, sub_doc="tree")
    assert set(state["state"]["nodes"]) == {"root", "a"}


async def test_apply_ops_with_enqueue_queues_the_work_with_the_commit_once(
    server_url: str, token: str
) -> None:
    async with in_process(server_url, token) as (client, _):
        ops = [{"type": "node.insert", "node_id": "job", "parent_id": "root"}]
        enqueue = [{"stage": "evaluate", "job_id": "job", "input": {"node": "job"}}]
        first = await call(
            client, "apply_ops", workspace_id=WS, sub_doc="tree", ops=ops, enqueue=enqueue
        )
        (answer,) = first["enqueued"]
        assert (answer["status"], answer["coalesced"]) == ("pending", False)
        # The same call with the op_ids of the first answer: nothing applied or enqueued again.
        again_ops = [{**ops[0], "op_id": first["op_ids"][0]}]
        again = await call(
            client, "apply_ops", workspace_id=WS, sub_doc="tree", ops=again_ops, enqueue=enqueue
        )
        assert again["results"][0]["duplicate"] is True
        assert again["enqueued"][0]["request_id"] == answer["request_id"]
        assert again["enqueued"][0]["coalesced"] is True
        row = await call(client, "get_request", workspace_id=WS, request_id=answer["request_id"])
    assert row["status"] == "pending"
