"""`ProcessRequest.to_json`: the JSON `dataclasses.asdict` gives, sharing nothing mutable."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from cv_server.queue.model import ProcessRequest

pytestmark = pytest.mark.unit


def _row(**over: Any) -> ProcessRequest:
    base: dict[str, Any] = dict(
        request_id="r1",
        workspace_id="ws",
        stage="ocr",
        job_id="j1",
        branch_path="main/b",
        input={"pages": [1, 2, {"deep": [True, None, 1.5]}], "name": "x"},
        worker_class="gpu",
        status="done",
        run=2,
        claim_token="tok",
        claimed_by="w1",
        lease_expires_at=12.5,
        available_at=1.0,
        dequeue_count=3,
        max_dequeues=5,
        result={"text": ["a", "b"], "meta": {"n": 2}},
        error=[{"code": "boom", "at": [1, 2]}],
        blob_ref="blob:1",
        cache="miss",
        created_at=0.5,
        claimed_at=1.5,
        finished_at=2.5,
        telemetry={"spans": [{"ms": 3}]},
        cancel_requested=True,
    )
    base.update(over)
    return ProcessRequest(**base)


def _reference(row: ProcessRequest, include_claim_token: bool) -> dict[str, Any]:
    data = dataclasses.asdict(row)
    if not include_claim_token:
        del data["claim_token"]
    return data


@pytest.mark.parametrize("include_claim_token", [False, True])
@pytest.mark.parametrize(
    "over",
    [
        {},
        {"input": None, "result": None, "error": None, "telemetry": None, "cache": None},
        {"input": [], "result": "plain", "error": 7, "telemetry": {}, "claim_token": None},
    ],
)
def test_to_json_equals_asdict_in_content_and_key_order(
    over: dict[str, Any], include_claim_token: bool
) -> None:
    row = _row(**over)
    got = row.to_json(include_claim_token=include_claim_token)
    want = _reference(row, include_claim_token)
    assert got == want
    assert json.dumps(got) == json.dumps(want)
    assert ("claim_token" in got) is include_claim_token


def test_to_json_with_now_adds_unclaimed_seconds_only() -> None:
    row = _row(status="pending", claimed_at=None)
    got = row.to_json(now=10.0)
    assert set(got) - set(row.to_json()) == {"unclaimed_seconds"}


def test_mutating_the_json_leaves_the_row_unchanged() -> None:
    row = _row()
    before = json.dumps(row.to_json(include_claim_token=True))
    out = row.to_json(include_claim_token=True)
    out["input"]["pages"][2]["deep"].append("x")
    out["input"]["name"] = "y"
    out["result"]["meta"]["n"] = 99
    out["result"]["text"].clear()
    out["error"][0]["at"].append(3)
    out["telemetry"]["spans"][0]["ms"] = 0
    assert json.dumps(row.to_json(include_claim_token=True)) == before
