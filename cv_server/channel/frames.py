"""What a worker may send on its channel (docs/protocol.md, "The worker channel"), read and
checked without I/O: `split_message` turns one websocket message into frames, `parse_hello` reads
the first, `parse_frame` each later one. A frame that breaks a rule is refused whole with a
`ChannelRefusal` (a stable `code`, the frame's `id` when it had a usable one): nothing of it is
applied, and the channel stays open.

The checks are the HTTP verbs' own (`cv_server.http.models`): names 1..64 characters, ids and
tokens without NUL (PostgreSQL text cannot hold one), payloads that JSON can write back (nested at
most 255 levels, integers within 64 bits), `cache` "hit" or "miss", and at most 1,000 completions a
frame.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import orjson

from cv_server.channel.slots import SLOTS_MAX
from cv_server.errors import CvServerError
from cv_server.queue.model import Completion

__all__ = [
    "FRAME_TYPES",
    "ChannelRefusal",
    "CompleteFrame",
    "DrainFrame",
    "FailFrame",
    "Frame",
    "FreeFrame",
    "HeartbeatFrame",
    "HelloFrame",
    "parse_frame",
    "parse_hello",
    "split_message",
]

#: The frames a worker sends after its `hello`, by their `type` member.
FRAME_TYPES: Final = ("free", "heartbeat", "complete", "fail", "drain")
#: Completions one `complete` frame may carry (the batch route's cap).
COMPLETIONS_MAX: Final = 1000
_EXPECTED: Final = ", ".join(f'"{kind}"' for kind in FRAME_TYPES)


class ChannelRefusal(CvServerError):
    """A frame refused whole: answered with an `error` frame carrying `code` (and `id`)."""

    def __init__(self, code: str, message: str, frame_id: Any = None, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.frame_id = frame_id
        self.extra = extra

    def to_json(self) -> dict[str, Any]:
        frame: dict[str, Any] = {"type": "error", "code": self.code, "message": self.message}
        if self.frame_id is not None:
            frame["id"] = self.frame_id
        frame.update(self.extra)
        return frame


@dataclass(frozen=True, slots=True)
class HelloFrame:
    """The first frame: which classes the worker claims, its id, and its free slots."""

    worker_classes: tuple[str, ...]
    worker_id: str
    slots: int


@dataclass(frozen=True, slots=True)
class FreeFrame:
    """The worker has `slots` more free slots."""

    slots: int


@dataclass(frozen=True, slots=True)
class HeartbeatFrame:
    frame_id: Any
    request_id: str
    claim_token: str


@dataclass(frozen=True, slots=True)
class CompleteFrame:
    """Completions (one commit) and the slots they free (`free`, claimed in the same commit)."""

    frame_id: Any
    completions: tuple[Completion, ...]
    free: int


@dataclass(frozen=True, slots=True)
class FailFrame:
    frame_id: Any
    request_id: str
    claim_token: str
    error: Any
    free: int


@dataclass(frozen=True, slots=True)
class DrainFrame:
    """The worker stops: no more requests; answered once none is on its way any more."""

    frame_id: Any


Frame = FreeFrame | HeartbeatFrame | CompleteFrame | FailFrame | DrainFrame


def split_message(text: str | bytes) -> list[Any]:
    """One websocket message as its frames: a JSON object, or a JSON array of them (handled in
    order, as if each had come alone). Raises `ChannelRefusal` `malformed_json`."""
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise ChannelRefusal("malformed_json", "a message is a JSON object or array") from None
    if isinstance(body, list) and body:
        return body
    return [body]


def _object(frame: Any) -> dict[str, Any]:
    if not isinstance(frame, dict):
        raise ChannelRefusal("malformed_json", "a frame must be a JSON object")
    return frame


def _frame_id(frame: dict[str, Any]) -> Any:
    """The `id` a request frame is answered under: an integer or a string of at most 64."""
    frame_id = frame.get("id")
    if isinstance(frame_id, bool) or not (
        (isinstance(frame_id, int) and -(2**63) <= frame_id < 2**63)
        or (isinstance(frame_id, str) and 0 < len(frame_id) <= 64)
    ):
        raise ChannelRefusal("invalid_field", "id must be an integer or a string of 1..64")
    return frame_id


def _text(frame: dict[str, Any], name: str, longest: int, frame_id: Any = None) -> str:
    value = frame.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= longest or "\x00" in value:
        raise ChannelRefusal(
            "invalid_field", f"{name} must be a string of 1..{longest} (no NUL)", frame_id
        )
    return value


def _count(frame: dict[str, Any], name: str, frame_id: Any = None, *, least: int = 0) -> int:
    value = frame.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= SLOTS_MAX:
        raise ChannelRefusal(
            "invalid_field", f"{name} must be an integer in {least}..{SLOTS_MAX}", frame_id
        )
    return value


def _payload(value: Any, name: str, frame_id: Any) -> Any:
    """A payload the store will keep: one JSON can write back (`http.queue._payload`'s rule)."""
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        reason = "holds an integer past 64 bits" if "64-bit" in str(exc) else "is nested too deeply"
        raise ChannelRefusal("invalid_field", f"{name} {reason}", frame_id) from None
    return value


def parse_hello(frame: Any) -> HelloFrame:
    """The channel's first frame, `{"type": "hello", "worker_classes": [...], "worker_id"?,
    "slots"?}`. Raises `ChannelRefusal`; the shell then closes the channel (nothing was asked
    that could go on)."""
    body = _object(frame)
    if body.get("type") != "hello":
        raise ChannelRefusal("unknown_message_type", 'the first frame is a "hello"')
    classes = body.get("worker_classes")
    if not isinstance(classes, list) or not 0 < len(classes) <= 64:
        raise ChannelRefusal("invalid_field", "worker_classes must be a list of 1..64 names")
    names = tuple(
        dict.fromkeys(_text({"worker_classes": c}, "worker_classes", 64) for c in classes)
    )
    worker_id = "anonymous" if body.get("worker_id") is None else _text(body, "worker_id", 256)
    return HelloFrame(names, worker_id, _count(body, "slots"))


def parse_frame(frame: Any) -> Frame:
    """A frame after the `hello`. When to call: for each frame of `split_message`, in order.
    Raises `ChannelRefusal` (`malformed_json`, `unknown_message_type`, `invalid_field`) with the
    frame's `id` when it had a usable one; the frame then changes nothing."""
    body = _object(frame)
    kind = body.get("type")
    if kind not in FRAME_TYPES:
        sent = json_short(kind)
        raise ChannelRefusal(
            "unknown_message_type", f'unknown frame "type" {sent}: expected one of {_EXPECTED}'
        )
    if kind == "free":
        return FreeFrame(_count(body, "slots", least=1))
    frame_id = _frame_id(body)
    if kind == "drain":
        return DrainFrame(frame_id)
    if kind == "complete":
        return CompleteFrame(frame_id, _completions(body, frame_id), _count(body, "free", frame_id))
    request_id = _text(body, "request_id", 256, frame_id)
    claim_token = _text(body, "claim_token", 256, frame_id)
    if kind == "heartbeat":
        return HeartbeatFrame(frame_id, request_id, claim_token)
    error = _payload(body.get("error"), "error", frame_id)
    return FailFrame(frame_id, request_id, claim_token, error, _count(body, "free", frame_id))


def _completions(body: dict[str, Any], frame_id: Any) -> tuple[Completion, ...]:
    items = body.get("completions")
    if not isinstance(items, list) or not 0 < len(items) <= COMPLETIONS_MAX:
        raise ChannelRefusal(
            "invalid_field", f"completions must be a list of 1..{COMPLETIONS_MAX} items", frame_id
        )
    completions = []
    for index, item in enumerate(items):
        try:
            completions.append(_completion(item, frame_id))
        except ChannelRefusal as exc:
            exc.message = f"completions[{index}]: {exc.message}"
            exc.args = (exc.message,)
            exc.extra["item_index"] = index
            raise
    return tuple(completions)


def _completion(item: Any, frame_id: Any) -> Completion:
    if not isinstance(item, dict):
        raise ChannelRefusal("invalid_field", "a completion must be a JSON object", frame_id)
    blob_ref = None if item.get("blob_ref") is None else _text(item, "blob_ref", 256, frame_id)
    if blob_ref is not None and item.get("result") is not None:
        raise ChannelRefusal(
            "invalid_field", "a completion names a blob_ref or a result, not both", frame_id
        )
    cache = item.get("cache")
    if cache not in (None, "hit", "miss"):
        raise ChannelRefusal("invalid_field", 'cache must be "hit" or "miss"', frame_id)
    telemetry = item.get("telemetry")
    try:  # fire-and-forget: telemetry no store could keep is dropped, never a refusal
        orjson.dumps(telemetry)
    except orjson.JSONEncodeError:
        telemetry = None
    return Completion(
        request_id=_text(item, "request_id", 256, frame_id),
        claim_token=_text(item, "claim_token", 256, frame_id),
        result=_payload(item.get("result"), "result", frame_id),
        error=_payload(item.get("error"), "error", frame_id),
        blob_ref=blob_ref,
        cache=cache,
        telemetry=telemetry,
    )


def json_short(value: Any) -> str:
    """A frame's `type` quoted short for an error message: never the repr of a huge value."""
    if isinstance(value, str):
        return orjson.dumps(value[:64]).decode()
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", list: "an array"}.get(
        type(value), "an object"
    )
