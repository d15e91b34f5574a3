"""The JSON Schemas in schemas/: up to date, valid, and in agreement with the models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from cv_mutations import OP_TYPES, InvalidOp, Op, parse_op
from cv_mutations.schema import SCHEMA_DIR, main, render_schemas
from tests.mutations.strategies import any_ops

PROPERTY = settings(max_examples=300, deadline=None)


def _validator(name: str) -> Draft202012Validator:
    schema = json.loads((SCHEMA_DIR / name).read_text("utf-8"))
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


UNION = _validator("op.schema.json")
PER_TYPE = {op_type: _validator(f"{op_type}.schema.json") for op_type in OP_TYPES}


def test_the_schema_files_on_disk_are_what_the_models_render() -> None:
    rendered = render_schemas()
    on_disk = {path.name: path.read_text("utf-8") for path in SCHEMA_DIR.glob("*.schema.json")}
    assert set(rendered) == {"op.schema.json", *(f"{t}.schema.json" for t in OP_TYPES)}
    assert on_disk == rendered


def test_the_check_command_reports_drift_and_write_repairs_it(tmp_path: Path) -> None:
    assert main(["--write", "--dir", str(tmp_path)]) == 0
    assert main(["--check", "--dir", str(tmp_path)]) == 0
    (tmp_path / "node.move.schema.json").write_text("{}\n", encoding="utf-8")
    (tmp_path / "stale.schema.json").write_text("{}\n", encoding="utf-8")
    assert main(["--check", "--dir", str(tmp_path)]) == 1
    assert main(["--write", "--dir", str(tmp_path)]) == 0
    assert not (tmp_path / "stale.schema.json").exists()
    assert main(["--check", "--dir", str(tmp_path)]) == 0


def test_every_schema_is_a_valid_draft_2020_12_schema_with_its_own_id() -> None:
    for name, text in render_schemas().items():
        body = json.loads(text)
        Draft202012Validator.check_schema(body)
        assert body["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        assert body["$id"].endswith("/" + name)


@pytest.mark.parametrize("op_type", OP_TYPES)
def test_type_is_required_on_the_wire_in_every_schema(op_type: str) -> None:
    # parse_op refuses an op without `type`; the schemas must not accept one either.
    example = {
        "node_id": "a",
        "parent_id": "root",
        "index": 0,
        "field": "n",
    }
    properties = json.loads(render_schemas()[f"{op_type}.schema.json"])["properties"]
    body = {key: value for key, value in example.items() if key in properties}
    assert not PER_TYPE[op_type].is_valid(body)
    assert PER_TYPE[op_type].is_valid({**body, "type": op_type})
    assert not UNION.is_valid(body)
    assert UNION.is_valid({**body, "type": op_type})


@PROPERTY
@given(any_ops)
def test_every_op_round_trips_through_json_text(op: Op) -> None:
    assert parse_op(json.loads(op.model_dump_json())) == op


@PROPERTY
@given(any_ops)
def test_every_op_satisfies_its_schema_and_parses_back_equal(op: Op) -> None:
    data = op.model_dump(mode="json")
    assert UNION.is_valid(data), list(UNION.iter_errors(data))
    per_type = PER_TYPE[op.type]
    assert per_type.is_valid(data), list(per_type.iter_errors(data))
    assert parse_op(data) == op
    for other_type, other in PER_TYPE.items():
        if other_type != op.type:
            assert not other.is_valid(data)


def _good(op_type: str) -> dict[str, Any]:
    examples: dict[str, dict[str, Any]] = {
        "node.insert": {"type": "node.insert", "node_id": "a", "parent_id": "root", "index": 0},
        "node.move": {"type": "node.move", "node_id": "a", "parent_id": "root", "index": 0},
        "node.delete": {"type": "node.delete", "node_id": "a"},
        "node.update": {"type": "node.update", "node_id": "a", "set": {"k": 1}, "unset": ["j"]},
        "node.increment": {"type": "node.increment", "node_id": "a", "field": "n", "by": 1},
    }
    return dict(examples[op_type])


# Instances both sides must refuse, with the code parse_op must give. Limits the schema cannot
# express (meta's 1 KiB, set/unset disjointness, NaN) are tested in test_ops.py instead.
INVALID: list[tuple[str, str, str, object]] = [
    ("node.delete", "type", "unknown_op_type", "node.rename"),
    ("node.delete", "node_id", "invalid_id", ""),
    ("node.delete", "node_id", "invalid_id", "has space"),
    ("node.delete", "node_id", "invalid_id", "a" * 129),
    ("node.move", "parent_id", "invalid_id", "p/q"),
    ("node.insert", "parent_id", "invalid_id", "é"),
    ("node.delete", "op_id", "invalid_id", "short"),
    ("node.delete", "op_id", "invalid_id", "x" * 65),
    ("node.delete", "op_id", "invalid_id", "dots.not.ok"),
    ("node.delete", "node_id", "invalid_field", 7),
    ("node.move", "index", "invalid_field", -1),
    ("node.move", "index", "invalid_field", "1"),
    ("node.insert", "index", "invalid_field", True),
    ("node.insert", "fields", "invalid_field", [1]),
    ("node.update", "unset", "invalid_field", "j"),
    ("node.update", "set", "invalid_field", {"": 1}),
    ("node.increment", "by", "invalid_field", "1"),
    ("node.increment", "by", "invalid_field", False),
    ("node.increment", "field", "invalid_field", ""),
    ("node.delete", "meta", "invalid_field", "x"),
    ("node.delete", "surprise", "invalid_field", 1),
]


@pytest.mark.parametrize(("op_type", "key", "code", "value"), INVALID)
def test_an_invalid_instance_is_refused_by_the_schema_and_by_parse_op(
    op_type: str, key: str, code: str, value: object
) -> None:
    good = _good(op_type)
    assert UNION.is_valid(good)
    assert PER_TYPE[op_type].is_valid(good)
    bad = {**good, key: value}
    assert not UNION.is_valid(bad)
    if key != "type":
        assert not PER_TYPE[op_type].is_valid(bad)
    with pytest.raises(InvalidOp) as caught:
        parse_op(bad)
    assert caught.value.code == code


@pytest.mark.parametrize("op_type", OP_TYPES)
def test_a_missing_required_field_is_refused_by_both(op_type: str) -> None:
    schema = json.loads(render_schemas()[f"{op_type}.schema.json"])
    for name in schema["required"]:
        body = {k: v for k, v in _good(op_type).items() if k != name}
        assert not PER_TYPE[op_type].is_valid(body)
        assert not UNION.is_valid(body)
        with pytest.raises(InvalidOp):
            parse_op(body)


_ID_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-.:"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=140))
def test_schema_and_parse_op_agree_on_every_node_id(candidate: str) -> None:
    # python-jsonschema matches `pattern` with re.search, where `$` also matches before a final
    # "\n"; ECMA-262 (the schema's dialect) and pydantic do not. The server, which is the gate,
    # refuses such ids (test_ops covers "a\n"); here they are left out to compare the rule itself.
    if candidate.endswith("\n"):
        candidate = candidate[:-1] + "!"
    body = {"type": "node.delete", "node_id": candidate}
    expected_valid = 1 <= len(candidate) <= 128 and all(c in _ID_CHARS for c in candidate)
    assert UNION.is_valid(body) is expected_valid
    assert PER_TYPE["node.delete"].is_valid(body) is expected_valid
    if expected_valid:
        assert parse_op(body).node_id == candidate
    else:
        with pytest.raises(InvalidOp) as caught:
            parse_op(body)
        assert caught.value.code == "invalid_id"
