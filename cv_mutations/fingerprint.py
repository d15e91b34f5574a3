"""Op fingerprints (docs/concepts.md): what `op_id_reuse` compares."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, Final

import orjson

__all__ = ["canonical_json", "fingerprint"]


#: The integers orjson can write; past them it raises.
_ORJSON_INTS: Final = range(-(2**63), 2**64)


def _big_ints_as_fragments(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _big_ints_as_fragments(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_big_ints_as_fragments(item) for item in value]
    if type(value) is int and value not in _ORJSON_INTS:
        return orjson.Fragment(str(value).encode())
    return value


def _canonical_bytes(value: Any) -> bytes:
    try:
        # orjson, at a quarter of the standard library's cost (the fingerprint is on the hot
        # path of every op).
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        pass
    # Integers past 64 bits are written as pre-rendered fragments, still by orjson. Falling back
    # to the standard library here gave a second text for the *same* float depending on its
    # neighbours (orjson writes 1e-05 as `0.00001` and 1e-07 as `1e-7`, `json` as `1e-05` and
    # `1e-07`): one text per JSON value is what makes a fingerprint comparable.
    try:
        return orjson.dumps(_big_ints_as_fragments(value), option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:  # nesting past orjson's 255 levels: only `json` writes it
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return text.encode()


def canonical_json(value: Any) -> str:
    """Sorted keys, no spaces, UTF-8 kept as-is: one text per JSON value."""
    return _canonical_bytes(value).decode()


#: What says who sent an op and when, not what it does: an app that submits the same intent
#: under its own op_id again gets a new `seq` and `minted_at`, and is a duplicate, not a reuse
#: (tests/client/io/test_http.py, the resend of a rejected op).
_NOT_FINGERPRINTED: Final = frozenset({"op_id", "client_id", "seq", "minted_at"})


def fingerprint(raw_op: Mapping[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of the op *as received*, without `op_id` and the
    lane fields (`client_id`, `seq`, `minted_at`).

    Taken before defaults are applied, so a server that changes a default never turns an honest
    retry into an `op_id_reuse`.
    """
    body = {key: value for key, value in raw_op.items() if key not in _NOT_FINGERPRINTED}
    return hashlib.sha256(_canonical_bytes(body)).hexdigest()
