"""Idempotency keys' pure parts (docs/queue.md): the fingerprint and the begin decision."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cv_server.queue.blobs import new_blob_ref
from cv_server.queue.idempotency import (
    InProgress,
    KeyRecord,
    Mismatch,
    Owned,
    StoredAnswer,
    decide_begin,
    request_fingerprint,
)


def record(
    state: str = "completed", fingerprint: str = "fp", expires_at: float = 100.0
) -> KeyRecord:
    return KeyRecord(
        fingerprint=fingerprint,
        state=state,  # type: ignore[arg-type]
        status_code=202 if state == "completed" else None,
        body={"id": 1} if state == "completed" else None,
        expires_at=expires_at,
    )


def test_the_fingerprint_covers_method_path_and_raw_body() -> None:
    base = request_fingerprint("POST", "/v1/x", b'{"a":1}')
    assert request_fingerprint("post", "/v1/x", b'{"a":1}') == base  # methods are case-blind
    assert request_fingerprint("PUT", "/v1/x", b'{"a":1}') != base
    assert request_fingerprint("POST", "/v1/y", b'{"a":1}') != base
    # Same JSON, different bytes: a different request as far as the key is concerned.
    assert request_fingerprint("POST", "/v1/x", b'{"a": 1}') != base


@given(st.text(max_size=8), st.binary(max_size=8), st.text(max_size=8), st.binary(max_size=8))
def test_no_part_of_the_fingerprint_bleeds_into_the_next(
    path1: str, body1: bytes, path2: str, body2: bytes
) -> None:
    same = (path1, body1) == (path2, body2)
    first = request_fingerprint("POST", path1, body1)
    assert (first == request_fingerprint("POST", path2, body2)) == same


def test_begin_decisions() -> None:
    assert decide_begin(None, "fp", 1.0) == Owned()
    assert decide_begin(record(), "fp", 1.0) == StoredAnswer(202, {"id": 1})
    assert decide_begin(record("in_progress"), "fp", 1.0) == InProgress()
    assert decide_begin(record(), "other", 1.0) == Mismatch()
    assert decide_begin(record("in_progress"), "other", 1.0) == Mismatch()


def test_an_expired_key_is_free_even_for_another_request() -> None:
    assert decide_begin(record(expires_at=100.0), "other", 100.0) == Owned()
    assert decide_begin(record(expires_at=100.0), "fp", 99.9) == StoredAnswer(202, {"id": 1})


def test_a_completed_key_without_a_status_is_refused() -> None:
    broken = KeyRecord("fp", "completed", None, {}, 100.0)
    with pytest.raises(ValueError, match="status"):
        decide_begin(broken, "fp", 1.0)


def test_a_blob_reference_wraps_the_callers_randomness() -> None:
    assert new_blob_ref("00ff") == "b_00ff"
    with pytest.raises(ValueError, match="hex"):
        new_blob_ref("")
