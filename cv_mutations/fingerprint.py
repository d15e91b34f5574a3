"""Op fingerprints (DESIGN §4): what `op_id_reuse` compares."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

__all__ = ["canonical_json", "fingerprint"]


def canonical_json(value: Any) -> str:
    """Sorted keys, no spaces, UTF-8 kept as-is: one text per JSON value."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def fingerprint(raw_op: Mapping[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of the op *as received*, without `op_id`.

    Taken before defaults are applied, so a server that changes a default never turns an honest
    retry into an `op_id_reuse`.
    """
    body = {key: value for key, value in raw_op.items() if key != "op_id"}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()
