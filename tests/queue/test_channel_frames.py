"""What a worker may send on its channel (`cv_server.channel.frames`): each rule the HTTP verbs
keep, refused whole with a stable code and the frame's `id`, never an exception of another kind."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cv_server.channel import (
    ChannelRefusal,
    CompleteFrame,
    DrainFrame,
    FailFrame,
    FreeFrame,
    HeartbeatFrame,
    parse_frame,
    parse_hello,
    split_message,
)


def test_a_hello_names_its_classes_once_each_and_defaults_its_id_and_slots() -> None:
    hello = parse_hello({"type": "hello", "worker_classes": ["a", "b", "a"]})
    assert (hello.worker_classes, hello.worker_id, hello.slots) == (("a", "b"), "anonymous", 0)


@pytest.mark.parametrize(
    "hello",
    [
        {"type": "free", "slots": 1},
        {"type": "hello"},
        {"type": "hello", "worker_classes": []},
        {"type": "hello", "worker_classes": ["x" * 65]},
        {"type": "hello", "worker_classes": ["a\x00"]},
        {"type": "hello", "worker_classes": ["a"], "slots": True},
        {"type": "hello", "worker_classes": ["a"], "worker_id": 7},
        [],
    ],
)
def test_a_bad_hello_is_refused(hello: Any) -> None:
    with pytest.raises(ChannelRefusal):
        parse_hello(hello)


def test_each_kind_of_frame_is_read() -> None:
    assert parse_frame({"type": "free", "slots": 2}) == FreeFrame(2)
    assert parse_frame({"type": "drain", "id": "d"}) == DrainFrame("d")
    beat = {"type": "heartbeat", "id": 1, "request_id": "r", "claim_token": "t"}
    assert parse_frame(beat) == HeartbeatFrame(1, "r", "t")
    fail = {**beat, "type": "fail", "error": {"code": "x"}, "free": 1}
    assert parse_frame(fail) == FailFrame(1, "r", "t", {"code": "x"}, 1)
    item = {"request_id": "r", "claim_token": "t", "result": [1], "cache": "hit"}
    complete = parse_frame({"type": "complete", "id": 2, "completions": [item]})
    assert isinstance(complete, CompleteFrame)
    assert (complete.free, complete.completions[0].result, complete.completions[0].cache) == (
        0,
        [1],
        "hit",
    )


def test_a_refusal_names_the_frame_id_and_the_item() -> None:
    items = [{"request_id": "r", "claim_token": "t"}, {"request_id": "r", "claim_token": ""}]
    with pytest.raises(ChannelRefusal) as refused:
        parse_frame({"type": "complete", "id": 9, "completions": items})
    answer = refused.value.to_json()
    assert (answer["code"], answer["id"], answer["item_index"]) == ("invalid_field", 9, 1)


def test_telemetry_no_store_could_keep_is_dropped_not_refused() -> None:
    item = {"request_id": "r", "claim_token": "t", "telemetry": {"n": 2**70}}
    frame = parse_frame({"type": "complete", "id": 1, "completions": [item]})
    assert isinstance(frame, CompleteFrame)
    assert frame.completions[0].telemetry is None


def test_a_message_is_one_frame_or_an_array_of_them() -> None:
    assert split_message('{"type": "drain", "id": 1}') == [{"type": "drain", "id": 1}]
    assert split_message("[1, 2]") == [1, 2]
    with pytest.raises(ChannelRefusal):
        split_message(b"\xff")


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(), st.lists, max_leaves=8))
def test_any_json_value_is_a_frame_or_a_refusal(value: Any) -> None:
    for frame in ({"type": "heartbeat", "id": value}, {"type": value}, value):
        codes: list[str] = []
        try:
            parse_frame(frame)
        except ChannelRefusal as refusal:
            codes.append(refusal.code)
        assert set(codes) <= {"malformed_json", "unknown_message_type", "invalid_field"}
