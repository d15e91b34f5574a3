"""The example stages (`evaluate`, `enrich`) run through a stage context against the real server."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import JsonValue

from cv_mutations import NodeInsert
from cv_workspace_client import WorkspaceClient
from cv_workspace_client.stage import ExpectedError
from cv_workspace_client.stages import JOBS, STAGES, ProviderMissingError, enrich, evaluate
from cv_workspace_client.stages.enrich import COMMUTE_FIELD, parse_minutes
from cv_workspace_client.stages.evaluate import Column, column_prompt, parse_columns
from cv_workspace_client.stages.fake_provider import demo_answer
from cv_workspace_client.testing import CountingFakeProvider

from .conftest import OpenClient
from .helpers import WS, RequestLog, stage_context

COLUMNS = [{"name": "fit", "prompt": "How well does it fit?"}, "seniority", "remote"]


async def job_fields(client: WorkspaceClient, job_id: str) -> dict[str, Any]:
    _, state = await client.get_state(WS, JOBS)
    return dict(state.nodes[job_id].fields)


async def test_evaluate_pays_one_call_per_column_and_writes_each_cell_on_the_job_node(
    server_url: str, open_client: OpenClient, request_log: RequestLog
) -> None:
    client = await open_client(server_url)
    await client.apply_op(WS, JOBS, NodeInsert(node_id="J1", parent_id="root", fields={"t": "x"}))
    provider = CountingFakeProvider()
    ctx = stage_context(client, job_id="J1", input={"columns": COLUMNS}, provider=provider)

    result = await evaluate(ctx)

    fields = await job_fields(client, "J1")
    columns = parse_columns({"columns": COLUMNS})
    expected = {c.name: demo_answer(column_prompt(c, "J1", {"t": "x"})) for c in columns}
    assert result == {"job_id": "J1", "values": expected, "computed": [c.name for c in columns]}
    assert {k: v for k, v in fields.items() if k.startswith("eval:")} == {
        f"eval:{name}": value for name, value in expected.items()
    }
    assert provider.calls == 3
    assert request_log.count("/locks/acquire") == 3
    assert request_log.count("/locks/release") == 3


async def test_evaluate_again_finds_every_cell_present_and_pays_nothing(
    server_url: str, open_client: OpenClient, request_log: RequestLog
) -> None:
    client = await open_client(server_url)
    provider = CountingFakeProvider()
    first = stage_context(
        client, request_id="r_" + "1" * 40, input={"columns": COLUMNS}, provider=provider
    )
    second = stage_context(
        client, request_id="r_" + "2" * 40, input={"columns": COLUMNS}, provider=provider
    )

    computed = await evaluate(first)
    again = await evaluate(second)

    assert again["values"] == computed["values"]
    assert again["computed"] == []
    assert provider.calls == 3
    assert request_log.count("/locks/acquire") == 3  # the second run never touched a lock


async def test_evaluate_inserts_a_missing_job_node(
    server_url: str, open_client: OpenClient
) -> None:
    client = await open_client(server_url)
    ctx = stage_context(
        client, job_id="new-job", input={"columns": ["fit"]}, provider=CountingFakeProvider()
    )

    await evaluate(ctx)

    _, state = await client.get_state(WS, JOBS)
    assert state.nodes["new-job"].parent == "root"
    assert "eval:fit" in state.nodes["new-job"].fields


@pytest.mark.parametrize(
    ("stage_input", "job_id"),
    [
        (None, "J1"),
        ({"columns": []}, "J1"),
        ({"columns": ["bad name"]}, "J1"),
        ({"columns": ["a", "a"]}, "J1"),
        ({"columns": [{"name": "a"}]}, "J1"),
        ({"columns": ["a"], "wait_seconds": "long"}, "J1"),
        ({"columns": ["a"]}, None),
        ({"columns": ["a"]}, "no spaces allowed"),
    ],
)
async def test_evaluate_answers_bad_input_with_an_expected_error(
    server_url: str, open_client: OpenClient, stage_input: Any, job_id: str | None
) -> None:
    client = await open_client(server_url)
    provider = CountingFakeProvider()
    ctx = stage_context(client, job_id=job_id, input=stage_input, provider=provider)

    with pytest.raises(ExpectedError) as raised:
        await evaluate(ctx)

    assert raised.value.code == "invalid_input"
    assert provider.calls == 0


async def test_a_worker_without_a_provider_fails_the_stage_so_another_can_run_it(
    server_url: str, open_client: OpenClient
) -> None:
    client = await open_client(server_url)
    ctx = stage_context(client, input={"columns": ["fit"]}, provider=None)
    with pytest.raises(ProviderMissingError) as raised:
        await evaluate(ctx)
    assert not isinstance(raised.value, ExpectedError)  # retried by the queue, not an answer


async def test_enrich_pays_one_call_per_job_for_its_commute(
    server_url: str, open_client: OpenClient, request_log: RequestLog
) -> None:
    client = await open_client(server_url)
    await client.apply_op(
        WS, JOBS, NodeInsert(node_id="J1", parent_id="root", fields={"location": "Lyon"})
    )
    provider = CountingFakeProvider(answer=demo_answer)
    runs = [
        stage_context(
            client,
            request_id=f"r_{i}" + "0" * 39,
            stage="enrich",
            job_id="J1",
            input={"origin": "Paris"},
            provider=provider,
        )
        for i in range(2)
    ]

    first = await enrich(runs[0])
    second = await enrich(runs[1])

    minutes = (await job_fields(client, "J1"))[COMMUTE_FIELD]
    assert isinstance(minutes, int)
    assert first == {"job_id": "J1", COMMUTE_FIELD: minutes, "computed": True}
    assert second == {"job_id": "J1", COMMUTE_FIELD: minutes, "computed": False}
    assert provider.calls == 1
    assert request_log.count("/locks/acquire") == 1
    prompt = next(iter(provider.counts()))
    assert "Paris" in prompt
    assert "Lyon" in prompt


async def test_enrich_answers_a_provider_reply_without_minutes_with_an_expected_error(
    server_url: str, open_client: OpenClient
) -> None:
    client = await open_client(server_url)
    provider = CountingFakeProvider(answer=lambda prompt: "about a while")
    ctx = stage_context(client, stage="enrich", job_id="J1", provider=provider)

    with pytest.raises(ExpectedError) as raised:
        await enrich(ctx)

    assert raised.value.code == "provider_bad_answer"
    assert COMMUTE_FIELD not in await job_fields(client, "J1")


def test_minutes_are_read_from_the_first_number_of_the_answer() -> None:
    assert parse_minutes("42") == 42
    assert parse_minutes("About 37.6 minutes by train") == 38
    assert parse_minutes("no idea") is None
    assert parse_minutes("-5") is None


def test_the_prompt_describes_the_job_without_its_computed_cells() -> None:
    column = Column("fit", "Fit?")
    job: dict[str, JsonValue] = {"title": "Dev", "eval:fit": "old", "commute_minutes": 3}
    assert column_prompt(column, "J1", job) == 'Fit?\n\nJob J1: {"title":"Dev"}'


def test_the_package_ships_evaluate_and_enrich() -> None:
    assert set(STAGES) == {"evaluate", "enrich"}
    assert STAGES["evaluate"].handler is evaluate
    assert STAGES["enrich"].handler is enrich
