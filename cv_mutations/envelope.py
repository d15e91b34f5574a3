"""`OpIdEnvelope`: the op_id and provenance every op carries (seed 000, layer 3)."""

from __future__ import annotations

import json
from typing import Final

from pydantic import BaseModel, ConfigDict, JsonValue, field_validator

from cv_mutations.ids import OpId

__all__ = ["META_MAX_BYTES", "OpIdEnvelope"]

#: `meta` is provenance (actor, request_id), not payload: capped so it cannot bloat the log.
META_MAX_BYTES: Final = 1024


class OpIdEnvelope(BaseModel):
    """Mixin carried by every op.

    `op_id` is the server's dedupe key within `(workspace_id, sub_doc)`. It is optional only for
    callers that guarantee a single attempt (server-internal code, tests, one-shot imports); any
    path that may retry must set it, and the SDK always does.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    op_id: OpId | None = None
    meta: dict[str, JsonValue] | None = None

    @field_validator("meta")
    @classmethod
    def _meta_is_small(cls, value: dict[str, JsonValue] | None) -> dict[str, JsonValue] | None:
        if value is None:
            return value
        size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
        if size > META_MAX_BYTES:
            raise ValueError(f"meta is {size} bytes serialized; at most {META_MAX_BYTES} allowed")
        return value
