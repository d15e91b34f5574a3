"""fingerprint(raw): what op_id_reuse compares (docs/concepts.md)."""

from __future__ import annotations

import re
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from cv_mutations import Op, canonical_json, fingerprint, parse_op
from tests.mutations.strategies import any_ops, json_values

RAW: dict[str, Any] = {
    "type": "node.update",
    "node_id": "a",
    "set": {"title": "T", "tags": ["x", "y"], "nested": {"b": 1, "a": 2}},
    "op_id": "abcdefgh12",
}


def test_fingerprint_is_a_sha256_hex_digest() -> None:
    assert re.fullmatch(r"[0-9a-f]{64}", fingerprint(RAW))


def test_fingerprint_ignores_the_op_id() -> None:
    without = {k: v for k, v in RAW.items() if k != "op_id"}
    assert fingerprint(RAW) == fingerprint({**RAW, "op_id": "anotherid1"}) == fingerprint(without)


def test_fingerprint_does_not_depend_on_key_order_at_any_depth() -> None:
    reordered = {
        "op_id": RAW["op_id"],
        "set": {"nested": {"a": 2, "b": 1}, "tags": ["x", "y"], "title": "T"},
        "node_id": "a",
        "type": "node.update",
    }
    assert fingerprint(reordered) == fingerprint(RAW)


def test_fingerprint_differs_when_any_field_changes() -> None:
    base = fingerprint(RAW)
    changed = [
        {**RAW, "node_id": "b"},
        {**RAW, "type": "node.delete"},
        {**RAW, "set": {**RAW["set"], "title": "U"}},
        {**RAW, "set": {**RAW["set"], "tags": ["y", "x"]}},  # list order is content
        {**RAW, "set": {**RAW["set"], "nested": {"b": 1, "a": 3}}},
        {**RAW, "meta": {"actor": "me"}},
        {**RAW, "unset": []},  # as received: an explicit default is not the same bytes
    ]
    digests = [fingerprint(body) for body in changed]
    assert base not in digests
    assert len(set(digests)) == len(digests)


def test_canonical_json_is_compact_sorted_and_keeps_utf8() -> None:
    assert (
        canonical_json({"b": [1, {"d": 1, "c": 2}], "a": "é"}) == '{"a":"é","b":[1,{"c":2,"d":1}]}'
    )


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.text(max_size=6), json_values, max_size=5), st.randoms(use_true_random=False)
)
def test_fingerprint_is_stable_under_any_key_permutation(raw: dict[str, Any], rnd: Any) -> None:
    items = list(raw.items())
    rnd.shuffle(items)
    assert fingerprint(dict(items)) == fingerprint(raw)


@settings(max_examples=200, deadline=None)
@given(any_ops)
def test_every_parsed_op_has_a_fingerprint_that_survives_a_round_trip(op: Op) -> None:
    # Anything parse_op accepts must fingerprint without error (no NaN, no lone surrogate), and
    # the op re-sent as the same JSON gets the same fingerprint.
    raw = op.model_dump(mode="json")
    digest = fingerprint(raw)
    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    assert fingerprint(parse_op(raw).model_dump(mode="json")) == digest


def test_fingerprint_matches_the_standard_librarys_canonical_json_even_for_big_integers() -> None:
    import hashlib
    import json

    for raw in (
        {"type": "node.update", "node_id": "a", "set": {"é": [1, 2.5, None, True], "b": "😀"}},
        {"type": "node.increment", "node_id": "a", "field": "n", "by": 2**80},
    ):
        text = json.dumps(raw, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        assert fingerprint(raw) == hashlib.sha256(text.encode()).hexdigest()
