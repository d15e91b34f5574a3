"""The op models (docs/ops.md): frozen pydantic models in one union discriminated on `type`.

Parsing never applies anything; it only says whether an op is well-formed. Whether it *fits* the
current state (does the node exist, would the move make a cycle) is the reducers' job.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from cv_mutations.envelope import OpIdEnvelope, json_size
from cv_mutations.ids import NodeId

__all__ = [
    "OP_ADAPTER",
    "OP_TYPES",
    "FieldName",
    "Fields",
    "InvalidOp",
    "NodeDelete",
    "NodeIncrement",
    "NodeInsert",
    "NodeMove",
    "NodeUpdate",
    "Op",
    "parse_op",
]

FieldName = Annotated[str, StringConstraints(min_length=1, max_length=128)]


def _is_json_text(value: dict[str, JsonValue]) -> dict[str, JsonValue]:
    json_size(value)  # refuses NaN, Infinity and lone surrogates (see json_size)
    return value


def _integral_float_as_int(value: object) -> object:
    # JSON Schema's "integer" is any number with a zero fraction, so the exported schemas accept
    # `"index": 1.0` (what a client's double, or Python's json.dumps(1.0), puts on the wire).
    # Strict mode refused it: the schema and parse_op disagreed. Only floats that *are*
    # integers pass; `true`, "1" and 1.5 are still refused.
    if type(value) is float and value.is_integer():
        return int(value)
    return value


def _has_json_text(value: int) -> int:
    # An integer longer than Python writes as text (sys.get_int_max_str_digits) passed the model
    # and then crashed the fingerprint and the client's encoder with a ValueError; inside
    # `fields` the same integer was already `invalid_field`. Only long integers pay for the check.
    if value.bit_length() > 64:
        json_size(value)
    return value


#: A position among a parent's children.
Index = Annotated[
    int, Field(ge=0), BeforeValidator(_integral_float_as_int), AfterValidator(_has_json_text)
]

#: Node fields as an op carries them: values that always serialize as JSON text.
Fields = Annotated[dict[FieldName, JsonValue], AfterValidator(_is_json_text)]


def _type_is_required(schema: dict[str, Any]) -> None:
    # `type` has a default so Python callers can write NodeMove(...), but on the wire it is the
    # discriminator and parse_op refuses an op without it; the schema must say so too.
    required = schema.setdefault("required", [])
    if "type" not in required:
        required.insert(0, "type")
    # The lane fields' rule (`OpIdEnvelope`: null is absent), which JSON Schema can state: a
    # validator in another language refuses what parse_op refuses, and no more
    # (tests/mutations/test_schema_parity.py).
    schema["allOf"] = [
        {
            "if": {"properties": {"seq": {"type": "integer"}}, "required": ["seq"]},
            "then": {
                "properties": {"client_id": {"type": "string"}, "op_id": {"type": "string"}},
                "required": ["client_id", "op_id"],
            },
        },
        {
            "if": {"properties": {"client_id": {"type": "string"}}, "required": ["client_id"]},
            "then": {"properties": {"seq": {"type": "integer"}}, "required": ["seq"]},
        },
    ]


class _OpModel(OpIdEnvelope):
    model_config = ConfigDict(json_schema_extra=_type_is_required)


class NodeInsert(_OpModel):
    """Insert a new leaf `node_id` under `parent_id` at `index` (appended when omitted)."""

    type: Literal["node.insert"] = "node.insert"
    node_id: NodeId
    parent_id: NodeId
    index: Index | None = None
    # default_factory leaves no `default` in the JSON Schema; clients generated from it must
    # know an absent `fields` is {} (and that null is refused): the published schema says it in
    # the description (cv_mutations.schema.PublishedJsonSchema).
    fields: Fields = Field(default_factory=dict, json_schema_extra={"default": {}})


class NodeMove(_OpModel):
    """Move `node_id` (with its subtree) to position `index` among `parent_id`'s children.

    `index` counts the new parent's children *after* the node has been taken out, so moving a node
    within its own parent behaves like "remove, then insert at index".
    """

    type: Literal["node.move"] = "node.move"
    node_id: NodeId
    parent_id: NodeId
    index: Index


class NodeDelete(_OpModel):
    """Delete `node_id` and its whole subtree."""

    type: Literal["node.delete"] = "node.delete"
    node_id: NodeId


class NodeUpdate(_OpModel):
    """Set and/or remove fields of `node_id`; no field may be both set and unset. `unset` of an
    absent field is a no-op."""

    type: Literal["node.update"] = "node.update"
    node_id: NodeId
    set: Fields = Field(default_factory=dict, json_schema_extra={"default": {}})
    unset: list[FieldName] = Field(default_factory=list, json_schema_extra={"default": []})

    @model_validator(mode="after")
    def _set_and_unset_are_disjoint(self) -> NodeUpdate:
        both = set(self.set).intersection(self.unset)
        if both:
            raise ValueError(f"fields both set and unset: {sorted(both)}")
        return self


class NodeIncrement(_OpModel):
    """Add `by` to the numeric field `field` of `node_id` (an absent field counts as 0).

    Deliberately not idempotent: a double apply is visible, which is how tests catch one.
    """

    type: Literal["node.increment"] = "node.increment"
    node_id: NodeId
    field: FieldName
    by: int | float = 1

    @field_validator("by")
    @classmethod
    def _by_is_finite(cls, value: int | float) -> int | float:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("by must be a finite number")
        if isinstance(value, int):
            _has_json_text(value)
        return value


Op = Annotated[
    NodeInsert | NodeMove | NodeDelete | NodeUpdate | NodeIncrement,
    Field(discriminator="type"),
]

#: The one adapter that parses any op; building it once keeps parsing cheap on the hot path.
OP_ADAPTER: Final[TypeAdapter[Op]] = TypeAdapter(Op)

OP_TYPES: Final = ("node.insert", "node.move", "node.delete", "node.update", "node.increment")


class InvalidOp(ValueError):
    """An op that is not well-formed. `code` is stable and travels to clients as-is.

    Codes: `unknown_op_type` (missing or unknown `type`), `invalid_id` (an id breaks its pattern),
    `invalid_field` (wrong type, missing or extra field, or a broken constraint).
    """

    def __init__(self, code: str, message: str, errors: list[dict[str, Any]] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.errors = errors or []


_ID_FIELDS: Final = frozenset({"op_id", "node_id", "parent_id"})


def _classify(exc: ValidationError) -> InvalidOp:
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    first = errors[0] if errors else {"type": "", "loc": (), "msg": str(exc)}
    kinds = {e["type"] for e in errors}
    if kinds & {"union_tag_invalid", "union_tag_not_found"}:
        code = "unknown_op_type"
    elif any(
        e["type"] == "string_pattern_mismatch" and e["loc"] and e["loc"][-1] in _ID_FIELDS
        for e in errors
    ):
        code = "invalid_id"
    else:
        code = "invalid_field"
    loc = ".".join(str(part) for part in first["loc"])
    message = f"{loc}: {first['msg']}" if loc else str(first["msg"])
    return InvalidOp(code, message, [dict(e) for e in errors])


def parse_op(data: object) -> Op:
    """Validate a decoded JSON value (a dict) into an `Op`, or raise `InvalidOp`."""
    if not isinstance(data, dict):
        raise InvalidOp("invalid_field", "an op must be a JSON object")
    try:
        return OP_ADAPTER.validate_python(data)
    except ValidationError as exc:
        raise _classify(exc) from None
