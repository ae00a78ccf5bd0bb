"""The tag of each tagged message type (``messages``, ``front``): the first frame of every
message on a data socket. Tags are part of the wire format."""

from __future__ import annotations

import msgspec

from omnistage.protocol.front import (
    FrontClose,
    FrontDone,
    FrontInput,
    FrontOpened,
    FrontQuery,
    FrontSnapshot,
    PipelineRequest,
)
from omnistage.protocol.messages import (
    Abort,
    AddRequest,
    HandshakeInit,
    HeadAnnounce,
    HeadAnnounceReply,
    HeadProbe,
    HeadProbeReply,
    Heartbeat,
    HeartbeatAck,
    Hello,
    InputChunk,
    OutputChunk,
    Ping,
    Ready,
    Redirect,
    Shutdown,
)

# The tag of each message type. Tags are part of the wire format: never reuse one.
TAGS: dict[type[msgspec.Struct], bytes] = {
    Hello: b"H",
    HandshakeInit: b"I",
    Ready: b"R",
    AddRequest: b"A",
    # b"C" was the old InputChunk (upstream outputs are OutputChunks now): never reuse it.
    InputChunk: b"c",
    Abort: b"X",
    Redirect: b"D",
    Shutdown: b"S",
    Ping: b"P",
    OutputChunk: b"O",
    Heartbeat: b"B",
    HeartbeatAck: b"K",
    HeadProbe: b"Q",
    HeadProbeReply: b"W",
    HeadAnnounce: b"J",
    HeadAnnounceReply: b"j",
    PipelineRequest: b"a",
    FrontOpened: b"o",
    FrontDone: b"d",
    FrontClose: b"x",
    FrontQuery: b"q",
    FrontInput: b"i",
    FrontSnapshot: b"s",
}
