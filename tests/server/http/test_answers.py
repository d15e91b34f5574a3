"""The hot routes' JSON answers (`cv_server.http.answers`): orjson's text, the standard
library's where orjson cannot write the value, the same document either way."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cv_server.http.answers import json_answer


def _document(body: Any) -> tuple[str | None, Any]:
    response = json_answer(body)
    assert isinstance(response.body, bytes)
    return response.headers["Content-Type"], json.loads(response.body)


@pytest.mark.parametrize(
    "body",
    [
        {"status": "done"},
        {"results": [{"request_id": "r1", "status": "done"}], "claimed": []},
        {"input": {"text": "naïve — ☃", "n": -(2**63), "big": 2**64 - 1, "x": 1.5}},
    ],
    ids=["small", "nested", "non-ascii-and-64-bit-edges"],
)
def test_an_answer_is_the_json_of_its_body(body: Any) -> None:
    assert _document(body) == ("application/json; charset=utf-8", body)


@pytest.mark.parametrize(
    "body",
    [{"n": 2**64}, {"n": -(2**63) - 1}, {"text": "\ud800"}],
    ids=["past-64-bits", "below-64-bits", "lone-surrogate"],
)
def test_what_orjson_cannot_write_is_answered_all_the_same(body: Any) -> None:
    assert _document(body) == ("application/json; charset=utf-8", body)


def test_status_and_headers_are_kept() -> None:
    response = json_answer({"a": 1}, status=202, headers={"Idempotency-Replayed": "true"})
    assert (response.status, response.headers["Idempotency-Replayed"]) == (202, "true")
