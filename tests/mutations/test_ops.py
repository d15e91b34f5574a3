"""parse_op and the op models: stable error codes, id rules, the envelope (docs/ops.md,
docs/problems.md)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cv_mutations import (
    META_MAX_BYTES,
    OP_TYPES,
    InvalidOp,
    NodeDelete,
    NodeIncrement,
    NodeInsert,
    NodeMove,
    NodeUpdate,
    OpIdEnvelope,
    new_op_id,
    parse_op,
)
from cv_mutations.ids import NANOID_ALPHABET, OP_ID_LENGTH

VALID: dict[str, dict[str, Any]] = {
    "node.insert": {"type": "node.insert", "node_id": "a", "parent_id": "root"},
    "node.move": {"type": "node.move", "node_id": "a", "parent_id": "root", "index": 0},
    "node.delete": {"type": "node.delete", "node_id": "a"},
    "node.update": {"type": "node.update", "node_id": "a", "set": {"k": 1}},
    "node.increment": {"type": "node.increment", "node_id": "a", "field": "n", "by": 2},
}
MODELS = {
    "node.insert": NodeInsert,
    "node.move": NodeMove,
    "node.delete": NodeDelete,
    "node.update": NodeUpdate,
    "node.increment": NodeIncrement,
}
#: Required fields per op type besides `type` (what a "missing field" test may drop).
REQUIRED = {
    "node.insert": ("node_id", "parent_id"),
    "node.move": ("node_id", "parent_id", "index"),
    "node.delete": ("node_id",),
    "node.update": ("node_id",),
    "node.increment": ("node_id", "field"),
}


def code_of(data: object) -> str:
    with pytest.raises(InvalidOp) as caught:
        parse_op(data)
    assert caught.value.message
    return caught.value.code


# -- well-formed ops ----------------------------------------------------------------------------


def test_the_valid_examples_cover_every_op_type() -> None:
    assert set(VALID) == set(OP_TYPES) == set(MODELS)


@pytest.mark.parametrize("op_type", OP_TYPES)
def test_parse_op_returns_the_model_named_by_type(op_type: str) -> None:
    op = parse_op(VALID[op_type])
    assert type(op) is MODELS[op_type]
    assert op.type == op_type
    assert op.op_id is None


def test_parse_op_applies_the_documented_defaults() -> None:
    insert = parse_op(VALID["node.insert"])
    assert isinstance(insert, NodeInsert)
    assert (insert.index, insert.fields) == (None, {})
    update = parse_op({"type": "node.update", "node_id": "a"})
    assert isinstance(update, NodeUpdate)
    assert (update.set, update.unset) == ({}, [])
    increment = parse_op({"type": "node.increment", "node_id": "a", "field": "n"})
    assert isinstance(increment, NodeIncrement)
    assert increment.by == 1


def test_increment_accepts_integer_and_float_steps() -> None:
    for by in (-3, 0, 2.5, 10**30):
        op = parse_op({**VALID["node.increment"], "by": by})
        assert isinstance(op, NodeIncrement)
        assert op.by == by
        assert type(op.by) is type(by)


# -- unknown_op_type -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad_type", ["node.rename", "NODE.INSERT", "", 5, None, ["node.insert"]])
def test_an_unknown_type_is_unknown_op_type(bad_type: object) -> None:
    assert code_of({**VALID["node.delete"], "type": bad_type}) == "unknown_op_type"


def test_an_op_without_type_is_unknown_op_type() -> None:
    body = dict(VALID["node.delete"])
    del body["type"]
    assert code_of(body) == "unknown_op_type"


# -- invalid_id ----------------------------------------------------------------------------------

BAD_NODE_IDS = ["", "has space", "slash/", "é", "a" * 129, "a\n", "\nroot", "tab\t"]


@pytest.mark.parametrize("bad", BAD_NODE_IDS)
@pytest.mark.parametrize(
    ("op_type", "id_field"),
    [
        ("node.insert", "node_id"),
        ("node.insert", "parent_id"),
        ("node.move", "node_id"),
        ("node.move", "parent_id"),
        ("node.delete", "node_id"),
        ("node.update", "node_id"),
        ("node.increment", "node_id"),
    ],
)
def test_a_node_id_outside_its_pattern_is_invalid_id(op_type: str, id_field: str, bad: str) -> None:
    assert code_of({**VALID[op_type], id_field: bad}) == "invalid_id"


def test_node_ids_may_use_the_whole_documented_alphabet_up_to_128_chars() -> None:
    for node_id in ["a", "A.b:c-d_e9", "x" * 128, "tree:0001.col-7"]:
        op = parse_op({**VALID["node.delete"], "node_id": node_id})
        assert isinstance(op, NodeDelete)
        assert op.node_id == node_id


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "short7c",
        "x" * 65,
        "has space1",
        "dotted.id",
        "colon:id1",
        "plus+plus",
        "ünïcödé1",
        "abcdefgh\n",
    ],
)
def test_an_op_id_outside_the_nanoid_alphabet_or_8_to_64_chars_is_invalid_id(bad: str) -> None:
    assert code_of({**VALID["node.delete"], "op_id": bad}) == "invalid_id"


@pytest.mark.parametrize("good", ["abcdefgh", "A-_09zZq", "x" * 64, "V1StGXR8_Z5jdHi6B-myT"])
def test_an_op_id_of_8_to_64_nanoid_chars_is_accepted(good: str) -> None:
    assert parse_op({**VALID["node.delete"], "op_id": good}).op_id == good


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=70))
def test_op_id_acceptance_is_exactly_the_documented_rule(candidate: str) -> None:
    allowed = 8 <= len(candidate) <= 64 and all(c in NANOID_ALPHABET for c in candidate)
    body = {**VALID["node.delete"], "op_id": candidate}
    if allowed:
        assert parse_op(body).op_id == candidate
    else:
        assert code_of(body) == "invalid_id"


def test_new_op_id_is_21_chars_of_the_nanoid_alphabet_and_fresh_each_time() -> None:
    minted = [new_op_id() for _ in range(1000)]
    assert OP_ID_LENGTH == 21
    for op_id in minted:
        assert re.fullmatch(r"[A-Za-z0-9_-]{21}", op_id), op_id
        assert parse_op({**VALID["node.delete"], "op_id": op_id}).op_id == op_id
    assert len(set(minted)) == len(minted)


def test_the_nanoid_alphabet_is_exactly_the_64_url_safe_symbols() -> None:
    assert len(NANOID_ALPHABET) == len(set(NANOID_ALPHABET)) == 64
    assert set(NANOID_ALPHABET) == set(
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"
    )


# -- invalid_field -------------------------------------------------------------------------------


@pytest.mark.parametrize("op_type", OP_TYPES)
def test_an_extra_field_is_invalid_field(op_type: str) -> None:
    assert code_of({**VALID[op_type], "surprise": 1}) == "invalid_field"


@pytest.mark.parametrize(
    ("op_type", "missing"), [(t, name) for t, names in REQUIRED.items() for name in names]
)
def test_a_missing_required_field_is_invalid_field(op_type: str, missing: str) -> None:
    body = dict(VALID[op_type])
    body.pop(missing, None)
    assert code_of(body) == "invalid_field"


WRONG_TYPES: list[tuple[str, str, object]] = [
    ("node.insert", "node_id", 5),
    ("node.insert", "parent_id", None),
    ("node.insert", "index", "3"),
    ("node.insert", "index", True),
    ("node.insert", "index", 1.5),
    ("node.insert", "index", -1),
    ("node.insert", "fields", []),
    ("node.insert", "fields", {"": 1}),
    ("node.insert", "fields", {"x" * 129: 1}),
    ("node.move", "index", None),
    ("node.move", "index", "0"),
    ("node.move", "index", -1),
    ("node.delete", "node_id", ["a"]),
    ("node.update", "set", "k=1"),
    ("node.update", "unset", "k"),
    ("node.update", "unset", [1]),
    ("node.update", "unset", [""]),
    ("node.increment", "field", 3),
    ("node.increment", "field", ""),
    ("node.increment", "by", "2"),
    ("node.increment", "by", True),
    ("node.increment", "by", None),
    ("node.increment", "by", float("nan")),
    ("node.increment", "by", float("inf")),
    ("node.delete", "op_id", 12345678),
    ("node.delete", "meta", "actor=me"),
    ("node.delete", "meta", ["actor"]),
]


@pytest.mark.parametrize(("op_type", "name", "value"), WRONG_TYPES)
def test_a_value_of_the_wrong_type_or_range_is_invalid_field(
    op_type: str, name: str, value: object
) -> None:
    assert code_of({**VALID[op_type], name: value}) == "invalid_field"


NOT_JSON_TEXT = [float("nan"), float("inf"), -float("inf"), "\ud800", [1, {"x": float("nan")}]]


@pytest.mark.parametrize("bad", NOT_JSON_TEXT)
@pytest.mark.parametrize(("op_type", "name"), [("node.insert", "fields"), ("node.update", "set")])
def test_field_values_without_a_json_text_form_are_invalid_field(
    op_type: str, name: str, bad: object
) -> None:
    # NaN, Infinity and lone surrogates would make the state unserializable and the fingerprint
    # crash; pydantic's JsonValue lets them through (inconsistently: NaN in node.update's `set`
    # and `meta` was accepted while the same NaN in node.insert's `fields` was not), so the models
    # refuse them explicitly.
    assert code_of({**VALID[op_type], name: {"k": bad}}) == "invalid_field"


@pytest.mark.parametrize("bad", NOT_JSON_TEXT)
@pytest.mark.parametrize("op_type", OP_TYPES)
def test_meta_values_without_a_json_text_form_are_invalid_field(op_type: str, bad: object) -> None:
    assert code_of({**VALID[op_type], "meta": {"k": bad}}) == "invalid_field"


def test_update_may_not_set_and_unset_the_same_field() -> None:
    assert code_of({**VALID["node.update"], "set": {"k": 1}, "unset": ["k"]}) == "invalid_field"


@pytest.mark.parametrize("not_an_object", [[], "node.delete", 5, None, [VALID["node.delete"]]])
def test_anything_but_a_json_object_is_invalid_field(not_an_object: object) -> None:
    assert code_of(not_an_object) == "invalid_field"


def test_invalid_op_carries_the_pydantic_errors_for_the_client() -> None:
    with pytest.raises(InvalidOp) as caught:
        parse_op({**VALID["node.move"], "index": -1})
    assert caught.value.errors
    assert caught.value.errors[0]["loc"][-1] == "index"
    assert "index" in caught.value.message


# -- envelope: meta and frozen models ------------------------------------------------------------


def _meta_of_size(size: int) -> dict[str, str]:
    overhead = len(json.dumps({"k": ""}, separators=(",", ":")))
    return {"k": "x" * (size - overhead)}


def test_meta_up_to_1_kib_is_kept_as_given() -> None:
    meta = _meta_of_size(META_MAX_BYTES)
    op = parse_op({**VALID["node.delete"], "meta": meta})
    assert META_MAX_BYTES == 1024
    assert op.meta == meta


def test_meta_over_1_kib_is_refused() -> None:
    assert code_of({**VALID["node.delete"], "meta": _meta_of_size(META_MAX_BYTES + 1)}) == (
        "invalid_field"
    )


def test_meta_size_counts_utf8_bytes_not_characters() -> None:
    # 400 three-byte characters: 400 chars, but 1,200 bytes on the wire.
    assert code_of({**VALID["node.delete"], "meta": {"k": "€" * 400}}) == "invalid_field"


@pytest.mark.parametrize("op_type", OP_TYPES)
def test_op_models_are_frozen(op_type: str) -> None:
    op = parse_op(VALID[op_type])
    for name in ("node_id", "op_id", "meta", "type"):
        with pytest.raises(ValidationError):
            setattr(op, name, "b")
    assert op == parse_op(VALID[op_type])


def test_the_envelope_alone_is_frozen_and_strict() -> None:
    envelope = OpIdEnvelope(op_id="abcdefgh")
    with pytest.raises(ValidationError):
        envelope.op_id = "ijklmnop"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        OpIdEnvelope.model_validate({"op_id": "abcdefgh", "other": 1})


def test_ops_compare_equal_by_value_whatever_the_construction_path() -> None:
    assert parse_op(VALID["node.delete"]) == NodeDelete(node_id="a")
    assert parse_op(VALID["node.delete"]) != NodeDelete(node_id="b")
