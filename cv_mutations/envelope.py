"""`OpIdEnvelope`: the op_id and provenance every op carries (docs/concepts.md, layer 3)."""

from __future__ import annotations

import json
import sys
from typing import ClassVar, Final

import orjson
from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator

from cv_mutations.ids import ClientId, OpId

__all__ = ["META_MAX_BYTES", "OpIdEnvelope", "json_size"]

#: `meta` is provenance (actor, request_id), not payload: capped so it cannot bloat the log.
META_MAX_BYTES: Final = 1024


def json_size(value: object) -> int:
    """Bytes of `value` as compact UTF-8 JSON; `ValueError` if it has no such form.

    pydantic's `JsonValue` lets NaN, Infinity and lone surrogates through (`allow_inf_nan` does not
    reach inside it), and integers longer than Python writes as text (`sys.get_int_max_str_digits`).
    Each would make the state unserializable as JSON text and crash the fingerprint, so they are
    refused at parse time, where they become `invalid_field`.
    """
    # orjson writes NaN/Infinity as `null` and refuses lone surrogates and integers past 64 bits:
    # only where it says null, or refuses, pay for the standard library's strict check (this
    # runs on every op with fields or meta; orjson is ~10x faster).
    try:
        data = orjson.dumps(value)
    except orjson.JSONEncodeError:
        data = b"null"
    if b"null" not in data:
        return len(data)
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        return len(text.encode())
    except UnicodeEncodeError as exc:
        raise ValueError("strings must be valid Unicode (no lone surrogates)") from exc
    except ValueError as exc:
        raise ValueError(
            "numbers must be finite (no NaN or Infinity) and integers at most "
            f"{sys.get_int_max_str_digits()} digits long"
        ) from exc


class OpIdEnvelope(BaseModel):
    """Mixin carried by every op.

    `op_id` is the server's dedupe key within `(workspace_id, sub_doc)`. It is optional only for
    callers that guarantee a single attempt (server-internal code, tests, one-shot imports); any
    path that may retry must set it, and the SDK always does.

    `client_id` and `seq` (always together) place the op in its client's lane: the ops one
    client sends to one `(workspace_id, sub_doc)`, numbered 1, 2, 3, ... in the order the client
    minted them. The server keeps the highest `seq` it decided per lane (its mark), so a resend
    at or below the mark is a duplicate however long ago it was decided (docs/ops.md#exactly-once).
    `minted_at` (unix milliseconds) is when the op was minted, kept across every resend: it lets
    a client without a lane prove an op's age. All three are optional.
    """

    # strict: the wire types are the schema's types. Lax mode would turn `true` into 1 and "3"
    # into 3, so an op the JSON Schema refuses would still be applied.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, strict=True)

    op_id: OpId | None = None
    client_id: ClientId | None = Field(
        default=None, description="The sending client's id; sent together with `seq`."
    )
    seq: int | None = Field(
        default=None,
        ge=1,
        le=2**53 - 1,
        description="The op's number in its client's lane (workspace, sub_doc, client_id), from 1,"
        " with no gap; sent together with `client_id`.",
    )
    minted_at: int | None = Field(
        default=None,
        ge=0,
        le=2**53 - 1,
        description="When the op was minted (unix milliseconds), the same on every resend.",
    )
    # The size cap is a rule JSON Schema cannot state: the description carries it to the schema.
    meta: dict[str, JsonValue] | None = Field(
        default=None,
        description=f"Provenance (actor, request_id): at most {META_MAX_BYTES} bytes as compact "
        "UTF-8 JSON.",
    )

    #: The delivery stamp the SDK adds: where and when the op was minted, not what it does.
    STAMP: ClassVar[frozenset[str]] = frozenset({"client_id", "seq", "minted_at"})

    def __eq__(self, other: object) -> bool:
        """The same op: same type, fields, op_id and meta. The delivery stamp (`client_id`,
        `seq`, `minted_at`) takes no part, as in the server's fingerprint: the op an app
        submitted equals the stamped one it reads back from `pending_ops()` or a subscription
        (tests/mutations/test_envelope_stamp.py)."""
        if not isinstance(other, OpIdEnvelope):
            return NotImplemented
        return type(self) is type(other) and self._unstamped() == other._unstamped()

    def __hash__(self) -> int:
        return hash((type(self), self.op_id))

    def _unstamped(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k not in self.STAMP}

    @field_validator("seq", "minted_at", mode="before")
    @classmethod
    def _integral_float_as_int(cls, value: object) -> object:
        # JSON Schema's "integer" takes 5.0 too (as `index` does in cv_mutations.ops): only a
        # float that is an integer passes; `true`, "5" and 5.5 are still refused.
        if type(value) is float and value.is_integer():
            return int(value)
        return value

    @model_validator(mode="after")
    def _lane_is_whole(self) -> OpIdEnvelope:
        if (self.client_id is None) != (self.seq is None):
            raise ValueError("client_id and seq are sent together, or neither")
        if self.seq is not None and self.op_id is None:
            raise ValueError("an op with a seq must carry an op_id")
        return self

    @field_validator("meta")
    @classmethod
    def _meta_is_small(cls, value: dict[str, JsonValue] | None) -> dict[str, JsonValue] | None:
        if value is None:
            return value
        size = json_size(value)
        if size > META_MAX_BYTES:
            raise ValueError(f"meta is {size} bytes serialized; at most {META_MAX_BYTES} allowed")
        return value
