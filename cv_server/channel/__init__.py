"""The worker channel (docs/protocol.md, "The worker channel"): one websocket per worker process
over which the server hands out claimed requests as the worker's slots free up, and the worker
sends heartbeats and reports as frames.

The rules are pure (`frames`: what a frame may say; `slots`: how many requests the server may
hand out); the aiohttp shell is `cv_server.http.worker_channel`.
"""

from cv_server.channel.frames import (
    FRAME_TYPES,
    ChannelRefusal,
    CompleteFrame,
    DrainFrame,
    FailFrame,
    Frame,
    FreeFrame,
    HeartbeatFrame,
    HelloFrame,
    parse_frame,
    parse_hello,
    split_message,
)
from cv_server.channel.slots import Slots

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
    "Slots",
    "parse_frame",
    "parse_hello",
    "split_message",
]
