"""Acceptance: `cv-workspace mcp` (issue 22, docs/mcp.md) as an agent host runs it.

The real `cv-server`, the counting fake provider endpoint (one process, so its count spans the
workers), two real `cv-worker` processes on the shipped stages, and the MCP server started as a
subprocess over stdio — driven by the `mcp` SDK's own client, as an agent host would: the tools
listed; `evaluate` enqueued, waited for and its cells read; each cell paid once though two MCP
sessions enqueue the same job at once; `apply_ops` retried with its first answer's op_ids moves
a counter once; refusals and malformed arguments as tool errors; resource notifications on
commit (both protocol eras); the cv-server restarting under it. One test over streamable HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, MCPDeprecationWarning, StdioServerParameters
from mcp_types import CallToolResult, ResourceUpdatedNotification

from cv_workspace_client.mcp_server import TOOL_NAMES
from cv_workspace_client.stages.evaluate import Column, column_prompt
from cv_workspace_client.stages.fake_provider import demo_answer
from tests.acceptance.procs import free_port, mint_cli_token
from tests.acceptance.three_layers_procs import Proc, provider_stats, server_cmd, worker_cmd

pytestmark = pytest.mark.acceptance

WS = "agents"
REPO = Path(__file__).resolve().parents[2]
WORKERS = 2
#: Bound on any one scenario once the processes are up.
SCENARIO_S = 60.0


@dataclass
class Fleet:
    server: Proc
    port: int
    db: Path
    provider_url: str
    token_file: Path
    log_dir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restart_server(self) -> None:
        """SIGKILL the cv-server, then start it again on the same port and database."""
        self.server.kill()
        self.server.stop()
        self.server = Proc(
            server_cmd(self.db, self.port), self.log_dir / "server.log", "listening on"
        )
        self.server.start()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("mcp")
    db = tmp / "cv.db"
    token = mint_cli_token(db, WS)
    token_file = tmp / "token"
    token_file.write_text(token + "\n")
    port = free_port()
    server = Proc(server_cmd(db, port), tmp / "server.log", "listening on")
    provider = Proc(
        ["-m", "cv_workspace_client.stages.fake_provider", "--delay", "0.2"],
        tmp / "provider.log",
        "listening on",
    )
    workers: list[Proc] = []
    state = Fleet(server, port, db, "", token_file, tmp)
    try:
        server.start()
        provider.start()
        state.provider_url = provider.url
        for i in range(WORKERS):
            args = worker_cmd(state.url, token, provider.url, f"w{i}", heartbeat=5.0)
            workers.append(Proc(args, tmp / f"worker{i}.log", "ready").spawn())
        for worker in workers:
            worker.wait_ready()
        yield state
    finally:
        for proc in [*workers, provider, state.server]:
            proc.stop()


def _mcp_args(fleet: Fleet, *extra: str) -> list[str]:
    return [
        "-m", "cv_workspace_client.cli", "workspace", "mcp",
        "--url", fleet.url, "--token-file", str(fleet.token_file), *extra,
    ]  # fmt: skip


@contextlib.asynccontextmanager
async def stdio_session(fleet: Fleet, *args: str, **options: Any) -> AsyncIterator[Client]:
    """The MCP server as an agent host starts it: a subprocess speaking MCP on its stdio."""
    params = StdioServerParameters(
        command=sys.executable, args=_mcp_args(fleet, *args), cwd=str(REPO)
    )
    async with Client(params, read_timeout_seconds=SCENARIO_S, **options) as client:
        yield client


async def call(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    """A tool's structured answer; the call must have succeeded."""
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, (tool, result.content)
    answer: dict[str, Any] | None = result.structured_content
    assert answer is not None
    return answer


async def refused(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    """A tool error's `{"code", "message", ...}`: isError, the JSON `{"error": {...}}` as its
    text and no structured content (docs/mcp.md), no traceback."""
    result: CallToolResult = await client.call_tool(tool, arguments)
    assert result.is_error, (tool, result.structured_content)
    assert result.structured_content is None, (tool, result.structured_content)
    (text,) = [block.text for block in result.content if block.type == "text"]
    assert "Traceback" not in text
    error: dict[str, Any] = json.loads(text)["error"]
    return error


def paid_prompts(fleet: Fleet, job_id: str) -> dict[str, int]:
    """The provider calls made for `job_id`'s cells, by prompt."""
    by_prompt: dict[str, int] = provider_stats(fleet.provider_url)["by_prompt"]
    return {p: n for p, n in by_prompt.items() if f"\n\nJob {job_id}: " in p}


def evaluate_input(*names: str) -> dict[str, Any]:
    return {"columns": [{"name": name, "prompt": f"Rate this job for {name}."} for name in names]}


def expected_value(job_id: str, name: str) -> str:
    prompt = column_prompt(Column(name, f"Rate this job for {name}."), job_id, {})
    return demo_answer(prompt)


async def test_lists_the_tools_with_their_schemas(fleet: Fleet) -> None:
    async with stdio_session(fleet) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}

    assert set(tools) == set(TOOL_NAMES)
    for tool in tools.values():
        assert tool.input_schema["type"] == "object", tool.name
        assert tool.output_schema is not None, tool.name
        assert tool.description, tool.name
    assert set(tools["apply_ops"].input_schema["required"]) == {"workspace_id", "sub_doc", "ops"}
    assert set(tools["wait_request"].input_schema["required"]) == {"workspace_id", "request_id"}
    hints = {name: tool.annotations for name, tool in tools.items()}
    read_only = {name for name, hint in hints.items() if hint is not None and hint.read_only_hint}
    assert read_only == {
        "get_state",
        "read_ops",
        "get_request",
        "wait_request",
        "list_requests",
        "list_schedules",
    }


async def test_enqueue_evaluate_wait_and_read_the_cells(fleet: Fleet) -> None:
    job = "J-enqueue"
    async with stdio_session(fleet) as client:
        enqueued = await call(
            client, "enqueue", workspace_id=WS, stage="evaluate", job_id=job,
            input=evaluate_input("fit", "seniority"),
        )  # fmt: skip
        waited = await call(
            client,
            "wait_request",
            workspace_id=WS,
            request_id=enqueued["request_id"],
            timeout_s=SCENARIO_S,
        )
        state = await call(client, "get_state", workspace_id=WS, sub_doc="jobs")
        shown = await call(
            client, "get_request", workspace_id=WS, request_id=enqueued["request_id"]
        )

    assert enqueued["coalesced"] is False
    assert enqueued["input_differs"] is False
    assert waited["status"] == "done", waited
    assert waited["error"] is None
    fields = state["state"]["nodes"][job]["fields"]
    assert fields == {
        "eval:fit": expected_value(job, "fit"),
        "eval:seniority": expected_value(job, "seniority"),
    }
    assert waited["result"]["values"] == {
        "fit": fields["eval:fit"],
        "seniority": fields["eval:seniority"],
    }
    assert shown["status"] == "done"
    assert shown["result"] == waited["result"]
    assert shown["attempts"] == 1
    assert sorted(paid_prompts(fleet, job).values()) == [1, 1]


async def test_two_sessions_enqueueing_one_job_at_once_pay_each_cell_once(fleet: Fleet) -> None:
    job = "J-race"
    columns = evaluate_input("a", "b", "c")

    async def agent() -> tuple[dict[str, Any], dict[str, Any]]:
        async with stdio_session(fleet) as client:
            enqueued = await call(
                client, "enqueue", workspace_id=WS, stage="evaluate", job_id=job, input=columns
            )
            waited = await call(
                client,
                "wait_request",
                workspace_id=WS,
                request_id=enqueued["request_id"],
                timeout_s=SCENARIO_S,
            )
            return enqueued, waited

    async with asyncio.timeout(SCENARIO_S * 2):
        (first, first_wait), (second, second_wait) = await asyncio.gather(agent(), agent())

    assert first["request_id"] == second["request_id"]  # the queue joined them: one request
    assert first_wait["status"] == second_wait["status"] == "done"
    assert first_wait["result"]["values"] == second_wait["result"]["values"]
    assert sorted(paid_prompts(fleet, job).values()) == [1, 1, 1]  # one call per cell


async def test_apply_ops_again_with_the_first_op_ids_moves_the_counter_once(fleet: Fleet) -> None:
    ops: list[dict[str, Any]] = [
        {"type": "node.insert", "node_id": "counter", "parent_id": "root"},
        {"type": "node.increment", "node_id": "counter", "field": "n"},
    ]
    async with stdio_session(fleet) as client:
        first = await call(client, "apply_ops", workspace_id=WS, sub_doc="tally", ops=ops)
        with_ids = [{**op, "op_id": op_id} for op, op_id in zip(ops, first["op_ids"], strict=True)]
        again = await call(client, "apply_ops", workspace_id=WS, sub_doc="tally", ops=with_ids)
        state = await call(client, "get_state", workspace_id=WS, sub_doc="tally")
        log = await call(client, "read_ops", workspace_id=WS, sub_doc="tally", since=0)

    assert [r["status"] for r in first["results"]] == ["committed", "committed"]
    assert [r["duplicate"] for r in first["results"]] == [False, False]
    assert again["op_ids"] == first["op_ids"]
    assert [r["duplicate"] for r in again["results"]] == [True, True]
    assert [r["clock"] for r in again["results"]] == [r["clock"] for r in first["results"]]
    assert state["state"]["nodes"]["counter"]["fields"] == {"n": 1}
    assert [op["op_id"] for op in log["ops"]] == first["op_ids"]  # each applied once


async def test_refusals_and_malformed_arguments_are_tool_errors(fleet: Fleet) -> None:
    tree = {"workspace_id": WS, "sub_doc": "tree"}
    async with stdio_session(fleet) as client:
        forbidden = await refused(client, "get_state", workspace_id="elsewhere", sub_doc="tree")
        enqueue_forbidden = await refused(
            client, "enqueue", workspace_id="elsewhere", stage="evaluate", job_id="J1"
        )
        unknown = await refused(client, "get_request", workspace_id=WS, request_id="no-such")
        not_a_list = await refused(client, "apply_ops", **tree, ops="node.insert")
        bad_op = await refused(client, "apply_ops", **tree, ops=[{"type": "node.explode"}])
        bad_id = await refused(
            client,
            "apply_ops",
            **tree,
            ops=[{"type": "node.insert", "node_id": "a b", "parent_id": "root"}],
        )
        write_forbidden = await refused(
            client, "apply_ops", workspace_id="elsewhere", sub_doc="tree",
            ops=[{"type": "node.insert", "node_id": "a", "parent_id": "root"}],
        )  # fmt: skip
        no_tool = await refused(client, "drop_everything", workspace_id=WS)
        missing = await refused(client, "wait_request", workspace_id=WS)
        negative = await refused(
            client, "wait_request", workspace_id=WS, request_id="r", timeout_s=-1
        )
        bad_ws = await refused(client, "get_state", workspace_id="no/such", sub_doc="tree")
        rejected = await call(
            client, "apply_ops", **tree,
            ops=[{"type": "node.delete", "node_id": "never-inserted"}],
        )  # fmt: skip
        # The session (and the MCP server) is still there, and answers.
        still = await call(client, "get_state", **tree)

    assert forbidden["code"] == enqueue_forbidden["code"] == "forbidden_workspace"
    assert unknown["code"] == "not_found"
    # The op was never applied; it waits under the op_id the answer names (a token replaced in
    # the token file would let it through, once: the server dedupes on that op_id).
    assert write_forbidden["code"] == "forbidden_workspace"
    assert write_forbidden["pending"] is True
    assert len(write_forbidden["op_ids"]) == 1
    assert no_tool["code"] == "unknown_tool"
    assert not_a_list["code"] == "invalid_arguments"
    assert "ops" in not_a_list["message"]
    assert bad_op["code"] == "unknown_op_type"
    assert bad_op["message"].startswith("ops[0]: ")
    assert bad_id["code"] == "invalid_id"
    assert missing["code"] == "invalid_arguments"
    assert "request_id" in missing["message"]
    assert negative["code"] == "invalid_arguments"
    assert "timeout_s" in negative["message"]
    assert bad_ws["code"] == "invalid_id"
    (outcome,) = rejected["results"]
    assert outcome["status"] == "rejected"
    assert outcome["code"] == "node_not_found"
    assert still["sub_doc"] == "tree"


async def test_a_wait_that_times_out_says_the_request_goes_on_until_cancelled(
    fleet: Fleet,
) -> None:
    async with stdio_session(fleet) as client:
        # No worker serves this stage: the request stays pending.
        enqueued = await call(client, "enqueue", workspace_id=WS, stage="unserved", job_id="J9")
        waited = await call(
            client,
            "wait_request",
            workspace_id=WS,
            request_id=enqueued["request_id"],
            timeout_s=0.5,
        )
        again = await call(
            client, "enqueue", workspace_id=WS, stage="unserved", job_id="J9", input={"other": 1}
        )
        listed = await call(client, "list_requests", workspace_id=WS, status="pending")
        cancelled = await call(
            client, "cancel_request", workspace_id=WS, request_id=enqueued["request_id"]
        )
        async with asyncio.timeout(SCENARIO_S / 4):  # a cancelled request's wait ends at once
            after = await call(
                client,
                "wait_request",
                workspace_id=WS,
                request_id=enqueued["request_id"],
                timeout_s=SCENARIO_S,
            )
        done = await call(client, "enqueue", workspace_id=WS, stage="evaluate", job_id="J-done",
                          input=evaluate_input("x"))  # fmt: skip
        await call(client, "wait_request", workspace_id=WS, request_id=done["request_id"])
        too_late = await refused(
            client, "cancel_request", workspace_id=WS, request_id=done["request_id"]
        )
        listed_cancelled = await call(client, "list_requests", workspace_id=WS, status="cancelled")

    assert waited["status"] == "timeout"
    assert waited["request_status"] == "pending"
    assert "goes on" in waited["note"]
    assert again["request_id"] == enqueued["request_id"]
    assert again["coalesced"] is True
    assert again["input_differs"] is True
    assert enqueued["request_id"] in [row["request_id"] for row in listed["requests"]]
    assert cancelled["status"] == "cancelled"
    assert after["status"] == "cancelled"
    assert too_late["code"] == "not_cancellable"
    assert [r["request_id"] for r in listed_cancelled["requests"]] == [enqueued["request_id"]]


async def test_a_committed_op_notifies_the_sub_docs_resource(fleet: Fleet) -> None:
    uri = f"cv://{WS}/docs/notes"
    async with stdio_session(fleet) as client:
        before = json.loads((await client.read_resource(uri)).contents[0].text)  # type: ignore[union-attr]
        async with client.listen(resource_subscriptions=[uri]) as subscription:
            await call(
                client, "apply_ops", workspace_id=WS, sub_doc="notes",
                ops=[{"type": "node.insert", "node_id": "n1", "parent_id": "root"}],
            )  # fmt: skip
            async with asyncio.timeout(SCENARIO_S):
                event = await anext(aiter(subscription))
        after = json.loads((await client.read_resource(uri)).contents[0].text)  # type: ignore[union-attr]

    assert event.uri == uri  # type: ignore[union-attr]
    assert after["clock"] == before["clock"] + 1
    assert "n1" in after["state"]["nodes"]


async def test_a_burst_of_commits_leaves_the_listen_stream_open(fleet: Fleet) -> None:
    # 3,000 ops in one call, told one notification per op, overflowed the listen stream's
    # backlog in the `mcp` SDK (1,024 events), which ended the agent's stream: a later commit
    # to another sub-doc on the same stream was never told.
    burst, other = f"cv://{WS}/docs/burst", f"cv://{WS}/docs/burst-after"
    insert = [{"type": "node.insert", "node_id": "b", "parent_id": "root"}]
    bumps = [{"type": "node.increment", "node_id": "b", "field": "n"}] * 3000
    async with stdio_session(fleet) as client:
        await call(client, "apply_ops", workspace_id=WS, sub_doc="burst", ops=insert)
        async with client.listen(resource_subscriptions=[burst, other]) as stream:
            await call(client, "apply_ops", workspace_id=WS, sub_doc="burst", ops=bumps)
            await call(client, "apply_ops", workspace_id=WS, sub_doc="burst-after", ops=insert)
            told: list[str] = []
            async with asyncio.timeout(SCENARIO_S):
                async for event in stream:  # ends early if the server ended the stream
                    told.append(event.uri)  # type: ignore[union-attr]
                    if event.uri == other:  # type: ignore[union-attr]
                        break
        state = await call(client, "get_state", workspace_id=WS, sub_doc="burst")

    assert told[-1] == other
    assert set(told) == {burst, other}
    assert state["state"]["nodes"]["b"]["fields"] == {"n": 3000}


@pytest.mark.filterwarnings("ignore::mcp.MCPDeprecationWarning")
async def test_a_handshake_era_client_is_notified_through_resources_subscribe(
    fleet: Fleet,
) -> None:
    uri = f"cv://{WS}/docs/legacy"
    updated: asyncio.Queue[str] = asyncio.Queue()

    async def on_message(message: Any) -> None:
        if isinstance(message, ResourceUpdatedNotification):
            updated.put_nowait(str(message.params.uri))

    async with stdio_session(fleet, mode="legacy", message_handler=on_message) as client:
        assert client.server_capabilities.resources is not None
        assert client.server_capabilities.resources.subscribe is True
        with pytest.warns(MCPDeprecationWarning):
            await client.subscribe_resource(uri)
        await call(
            client, "apply_ops", workspace_id=WS, sub_doc="legacy",
            ops=[{"type": "node.insert", "node_id": "x", "parent_id": "root"}],
        )  # fmt: skip
        async with asyncio.timeout(SCENARIO_S):
            assert await updated.get() == uri


async def test_survives_the_cv_server_restarting_under_it(fleet: Fleet) -> None:
    ops = [{"type": "node.insert", "node_id": "before", "parent_id": "root"}]
    async with stdio_session(fleet) as client:
        await call(client, "apply_ops", workspace_id=WS, sub_doc="restart", ops=ops)
        fleet.restart_server()
        after = [{"type": "node.insert", "node_id": "after", "parent_id": "root"}]
        async with asyncio.timeout(SCENARIO_S):
            applied = await call(client, "apply_ops", workspace_id=WS, sub_doc="restart", ops=after)
            state = await call(client, "get_state", workspace_id=WS, sub_doc="restart")

    assert applied["results"][0]["status"] == "committed"
    assert set(state["state"]["nodes"]) == {"root", "before", "after"}


async def test_a_write_the_server_never_answered_is_applied_once_across_an_mcp_restart(
    fleet: Fleet,
) -> None:
    outbox = str(fleet.log_dir / "agent-outbox.db")
    insert = [{"type": "node.insert", "node_id": "c", "parent_id": "root"}]
    bump = [{"type": "node.increment", "node_id": "c", "field": "n"}]
    async with stdio_session(fleet, "--outbox", outbox) as client:
        await call(client, "apply_ops", workspace_id=WS, sub_doc="durable", ops=insert)
        fleet.server.kill()
        # No answer, after the SDK's retries: the op waits in the outbox file under its op_id.
        unanswered = await refused(
            client, "apply_ops", workspace_id=WS, sub_doc="durable", ops=bump
        )
    # The MCP server is gone too (the host closed it); the cv-server comes back.
    fleet.restart_server()
    retry = [{**bump[0], "op_id": unanswered["op_ids"][0]}]
    async with stdio_session(fleet, "--outbox", outbox) as client:
        # The agent retries with the op_id it was given; the new MCP server replayed the outbox
        # first (ops to one sub-doc go in order), so this is the second send of one op.
        again = await call(client, "apply_ops", workspace_id=WS, sub_doc="durable", ops=retry)
        state = await call(client, "get_state", workspace_id=WS, sub_doc="durable")

    assert unanswered["code"] == "connection_failed"
    assert unanswered["pending"] is True
    assert again["results"][0]["duplicate"] is True
    assert state["state"]["nodes"]["c"]["fields"] == {"n": 1}


@pytest.mark.filterwarnings("ignore::mcp.MCPDeprecationWarning")
async def test_the_same_tools_over_streamable_http(fleet: Fleet) -> None:
    legacy_updates: asyncio.Queue[str] = asyncio.Queue()

    async def on_message(message: Any) -> None:
        if isinstance(message, ResourceUpdatedNotification):
            legacy_updates.put_nowait(str(message.params.uri))

    http = Proc(
        [*_mcp_args(fleet, "--transport", "http", "--port", "0")],
        fleet.log_dir / "mcp-http.log",
        "listening on",
    )
    http.start()
    job = "J-http"
    try:
        async with Client(http.url, read_timeout_seconds=SCENARIO_S) as client:
            names = {tool.name for tool in (await client.list_tools()).tools}
            async with client.listen(resource_subscriptions=[f"cv://{WS}/docs/jobs"]) as events:
                enqueued = await call(
                    client, "enqueue", workspace_id=WS, stage="evaluate", job_id=job,
                    input=evaluate_input("fit"),
                )  # fmt: skip
                waited = await call(
                    client,
                    "wait_request",
                    workspace_id=WS,
                    request_id=enqueued["request_id"],
                    timeout_s=SCENARIO_S,
                )
                async with asyncio.timeout(SCENARIO_S):
                    event = await anext(aiter(events))
            state = await call(client, "get_state", workspace_id=WS, sub_doc="jobs")
            error = await refused(client, "get_state", workspace_id="elsewhere", sub_doc="jobs")
        # A handshake-era client on the same endpoint: resources/subscribe, notified on its
        # session's stream.
        async with Client(http.url, mode="legacy", message_handler=on_message) as legacy:
            await legacy.subscribe_resource(f"cv://{WS}/docs/http-legacy")
            await call(
                legacy, "apply_ops", workspace_id=WS, sub_doc="http-legacy",
                ops=[{"type": "node.insert", "node_id": "x", "parent_id": "root"}],
            )  # fmt: skip
            async with asyncio.timeout(SCENARIO_S):
                legacy_uri = await legacy_updates.get()
    finally:
        http.stop()

    assert names == set(TOOL_NAMES)
    assert waited["status"] == "done"
    assert state["state"]["nodes"][job]["fields"] == {"eval:fit": expected_value(job, "fit")}
    assert event.uri == f"cv://{WS}/docs/jobs"  # type: ignore[union-attr]
    assert error["code"] == "forbidden_workspace"
    assert list(paid_prompts(fleet, job).values()) == [1]
    assert legacy_uri == f"cv://{WS}/docs/http-legacy"
