"""The exported JSON Schemas (schemas/) accept what parse_op and the reducers accept.

Apps in other languages validate ops with schemas/ before sending; the server parses with
parse_op. What one side accepts the other must accept, the schema must compile in the common
validators, and what it says about defaults and limits must be what parse_op does.

Instances are generated from the exported schema itself (a small interpreter of the keywords the
export uses): hypothesis-jsonschema would do it, but 0.23.1 fails inside Hypothesis 6.170 with
`AttributeError: 'many' object has no attribute 'more'`.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from jsonschema_specifications import REGISTRY  # type: ignore[import-untyped]

from cv_mutations import (
    META_MAX_BYTES,
    OP_TYPES,
    InvalidOp,
    NodeIncrement,
    NodeUpdate,
    SubDocState,
    apply_op,
    canonical_json,
    fingerprint,
    parse_op,
)
from cv_mutations.envelope import json_size
from cv_mutations.schema import SCHEMA_DIR, main, render_schemas
from tests.mutations.helpers import outcome
from tests.mutations.strategies import json_values, numbers

PARITY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _load(name: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((SCHEMA_DIR / name).read_text("utf-8"))
    return body


SCHEMAS = {
    name: _load(name) for name in ["op.schema.json", *(f"{t}.schema.json" for t in OP_TYPES)]
}
UNION = Draft202012Validator(SCHEMAS["op.schema.json"])

# -- instances drawn from the exported schema itself ----------------------------------------------

#: Any JSON value a decoder can hand the server (what the schema's `{}` allows): orjson reads
#: integers up to 64 bits, no NaN or Infinity, no lone surrogates.
_any_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def from_schema(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values `schema` accepts, for the keywords the export uses (anything else fails loudly)."""
    if "$ref" in schema:
        target = root["$defs"][schema["$ref"].removeprefix("#/$defs/")]
        return st.deferred(lambda: from_schema(target, root))
    for combinator in ("anyOf", "oneOf"):
        if combinator in schema:
            return st.one_of([from_schema(branch, root) for branch in schema[combinator]])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind is None:
        return _any_json
    if kind == "null":
        return st.none()
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        return st.text(min_size=schema.get("minLength", 0), max_size=schema.get("maxLength", 12))
    if kind in ("integer", "number"):
        ints = st.integers(
            min_value=schema.get("minimum", -(2**63)), max_value=schema.get("maximum", 2**64 - 1)
        )
        if kind == "number":
            return ints | st.floats(allow_nan=False, allow_infinity=False)
        # JSON Schema's integer is any number with a zero fraction: 1.0 is one.
        return ints | ints.map(float).filter(math.isfinite)
    if kind == "array":
        return st.lists(from_schema(schema["items"], root), max_size=3)
    assert kind == "object", schema
    properties = schema.get("properties")
    if properties is not None:
        assert schema.get("additionalProperties") is False, schema
        required = set(schema.get("required", []))
        # `allOf` of `if`/`then` rules between properties (the lane fields): drawn, then kept
        # only where each rule holds.
        rules = Draft202012Validator({"allOf": schema.get("allOf", [])})
        return st.fixed_dictionaries(
            {k: from_schema(v, root) for k, v in properties.items() if k in required},
            optional={k: from_schema(v, root) for k, v in properties.items() if k not in required},
        ).filter(rules.is_valid)
    names = schema.get("propertyNames", {})
    keys = st.text(min_size=names.get("minLength", 0), max_size=names.get("maxLength", 8))
    return st.dictionaries(keys, from_schema(schema["additionalProperties"], root), max_size=3)


INSTANCES = {name: from_schema(body, body) for name, body in SCHEMAS.items()}


def _inside_the_limits_no_schema_can_say(body: dict[str, Any]) -> bool:
    """The two rules of parse_op the schema can only describe (see the descriptions test)."""
    meta = body.get("meta")
    if meta is not None and json_size(meta) > META_MAX_BYTES:
        return False
    return not set(body.get("set", {})).intersection(body.get("unset", []))


@PARITY
@given(st.sampled_from(sorted(INSTANCES)), st.data())
def test_every_instance_the_schema_accepts_parses_applies_and_round_trips(
    name: str, data: st.DataObject
) -> None:
    body = data.draw(INSTANCES[name])
    validator = Draft202012Validator(SCHEMAS[name])
    assert validator.is_valid(body), list(validator.iter_errors(body))
    assume(_inside_the_limits_no_schema_can_say(body))
    op = parse_op(body)  # never InvalidOp for a schema-valid instance
    assert UNION.is_valid(op.model_dump(mode="json"))
    fingerprint(body)
    # Applied to a state that holds the ids and numeric fields it may name: no other exception
    # than OpRejected, and the state still reads back from its JSON text as the same state.
    state = SubDocState.empty()
    state.nodes["root"].fields.update({"n": 1, "f": -0.0, "big": 2**64, "s": "x"})
    outcome(state, op)
    assert SubDocState.loads(state.dumps()) == state


# -- the union: portable 2020-12, every op type once ----------------------------------------------


def _vocabulary() -> frozenset[str]:
    meta = REGISTRY.contents("https://json-schema.org/draft/2020-12/schema")
    assert isinstance(meta, dict)
    words: set[str] = set()
    for uri in meta["$vocabulary"]:
        part = REGISTRY.contents(uri.replace("/vocab/", "/meta/"))
        assert isinstance(part, dict)
        words.update(part["properties"])
    return frozenset(words)


_SCHEMA_MAPS = ("properties", "$defs", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")


_NOT_SCHEMAS = ("const", "default", "examples")


def _keywords(schema: dict[str, Any]) -> Iterator[str]:
    """Every keyword used at a schema position inside `schema` (not inside const/default)."""
    for key, value in schema.items():
        yield key
        if key in _SCHEMA_MAPS:
            for sub in value.values():
                yield from _keywords(sub)
        elif key in _SCHEMA_LISTS:
            for sub in value:
                yield from _keywords(sub)
        elif isinstance(value, dict) and key not in _NOT_SCHEMAS:
            yield from _keywords(value)


@pytest.mark.parametrize("name", sorted(render_schemas()))
def test_every_schema_uses_only_json_schema_2020_12_keywords(name: str) -> None:
    # pydantic adds OpenAPI's `discriminator` (with `mapping`) to the union. Ajv, the common
    # JavaScript validator, refuses to compile such a schema with its defaults ("strict mode:
    # unknown keyword: discriminator"), and with `discriminator: true` too ("discriminator:
    # mapping is not supported"): a JS app could not validate a single op.
    unknown = set(_keywords(json.loads(render_schemas()[name]))) - _vocabulary()
    assert not unknown


def test_the_union_holds_every_op_type_once_and_each_branch_is_its_own_schema() -> None:
    union = json.loads(render_schemas()["op.schema.json"])
    branches = [union["$defs"][ref["$ref"].removeprefix("#/$defs/")] for ref in union["oneOf"]]
    assert sorted(branch["properties"]["type"]["const"] for branch in branches) == sorted(OP_TYPES)
    for branch in branches:
        op_type = branch["properties"]["type"]["const"]
        alone = json.loads(render_schemas()[f"{op_type}.schema.json"])
        assert {k: v for k, v in alone.items() if k not in ("$schema", "$id", "$defs")} == branch
        assert "type" in branch["required"]


# -- the drift check ------------------------------------------------------------------------------


def test_check_reports_a_schema_file_write_would_delete(tmp_path: Path) -> None:
    # `--write` deletes a schema no model renders any more (an op type renamed or dropped); a
    # `--check` that passed over it let clients keep validating against a retired op.
    assert main(["--write", "--dir", str(tmp_path)]) == 0
    (tmp_path / "node.rename.schema.json").write_text("{}\n", encoding="utf-8")
    assert main(["--check", "--dir", str(tmp_path)]) == 1
    assert main(["--write", "--dir", str(tmp_path)]) == 0
    assert main(["--check", "--dir", str(tmp_path)]) == 0


# -- what the schema says: defaults and limits -----------------------------------------------------

_MINIMAL: dict[str, dict[str, Any]] = {
    "node.insert": {"type": "node.insert", "node_id": "a", "parent_id": "root"},
    "node.move": {"type": "node.move", "node_id": "a", "parent_id": "root", "index": 0},
    "node.delete": {"type": "node.delete", "node_id": "a"},
    "node.update": {"type": "node.update", "node_id": "a"},
    "node.increment": {"type": "node.increment", "node_id": "a", "field": "n"},
}


#: How an optional property's description says what parse_op fills in for it.
_WHEN_ABSENT = re.compile(r"When absent: `(.*)`\.$")


@pytest.mark.parametrize("op_type", OP_TYPES)
def test_every_optional_property_is_optional_and_says_what_parse_op_fills_in(
    op_type: str,
) -> None:
    # A `default` reads as "always present" to generators (openapi-typescript's default mode
    # types such a member as required), so an optional property carries none; a default other
    # than null is said in its description instead, and `null` stays refused where the schema
    # allows no null (`fields`, `set`, `unset`).
    schema = SCHEMAS[f"{op_type}.schema.json"]
    minimal = _MINIMAL[op_type]
    assert set(minimal) == set(schema["required"])
    op = parse_op(minimal)
    for name, prop in schema["properties"].items():
        if name in schema["required"]:
            continue
        assert "default" not in prop, name
        said = _WHEN_ABSENT.search(prop.get("description", ""))
        filled = op.model_dump(mode="json")[name]
        if said is None:
            assert filled is None, name
            continue
        value = json.loads(said.group(1))
        assert Draft202012Validator(schema).is_valid({**minimal, name: value})
        assert filled == value, name


def test_the_limits_the_schema_cannot_express_are_in_its_descriptions() -> None:
    for name, schema in SCHEMAS.items():
        for branch in [schema, *schema.get("$defs", {}).values()]:
            meta = branch.get("properties", {}).get("meta")
            if meta is not None:
                assert f"{META_MAX_BYTES} bytes" in meta.get("description", ""), name
    update = SCHEMAS["node.update.schema.json"]
    assert "both" in update["description"]


# -- integers that have no JSON text -------------------------------------------------------------

_DIGITS = sys.get_int_max_str_digits()
_TOO_LONG = 10**_DIGITS  # one digit more than Python writes as text


@pytest.mark.parametrize(
    ("op_type", "key"), [("node.increment", "by"), ("node.insert", "index"), ("node.move", "index")]
)
def test_an_integer_with_no_json_text_is_invalid_field_like_in_fields(
    op_type: str, key: str
) -> None:
    # `set: {"n": 10**4300}` was refused, `by: 10**4300` accepted: then fingerprint(raw), the
    # client's outbox encoder and the state's dumps() raised ValueError instead of InvalidOp.
    assert _DIGITS > 0
    body = {**_MINIMAL[op_type], key: _TOO_LONG}
    with pytest.raises(InvalidOp) as caught:
        parse_op(body)
    assert caught.value.code == "invalid_field"
    assert "digits" in caught.value.message
    # One digit less is a JSON integer: accepted, and fingerprinted.
    parse_op({**body, key: _TOO_LONG // 10})
    fingerprint({**body, key: _TOO_LONG // 10})


def test_an_increment_whose_sum_would_have_no_json_text_is_not_a_number() -> None:
    # Both numbers can be written, their sum (one digit longer) cannot: applied, it left a state
    # whose dumps() raised ValueError (snapshot, GET state and every later fingerprint-free read).
    largest = _TOO_LONG - 1
    state = SubDocState.empty()
    apply_op(state, NodeUpdate(node_id="root", set={"n": largest}))
    before = state.dumps()
    assert outcome(state, NodeIncrement(node_id="root", field="n", by=largest)) == "not_a_number"
    assert state.dumps() == before
    assert outcome(state, NodeIncrement(node_id="root", field="n", by=-largest)) is None
    assert state.nodes["root"].fields["n"] == 0


# -- reducers on a state read back from its JSON text ----------------------------------------------


@PARITY
@given(json_values, numbers, st.text(min_size=1, max_size=4))
def test_a_reloaded_state_answers_an_increment_like_the_cached_one(
    value: Any, by: int | float, name: str
) -> None:
    # -0.0, integers past 2**53, unicode field names, empty strings, nested values: the cached
    # state and its snapshot must answer alike and stay byte-equal.
    cached = SubDocState.empty()
    apply_op(cached, NodeUpdate(node_id="root", set={name: value}))
    reloaded = SubDocState.loads(cached.dumps())
    op = NodeIncrement(node_id="root", field=name, by=by)
    assert outcome(cached, op) == outcome(reloaded, op)
    assert cached.dumps() == reloaded.dumps()
    assert canonical_json(cached.to_json()) == canonical_json(reloaded.to_json())
