"""Wire codec: tagged frames round-trip; anything malformed is a ProtocolError."""

from __future__ import annotations

import random

import msgspec
import pytest

from omnistage.protocol import codec
from omnistage.protocol.errors import ProtocolError
from omnistage.protocol.front import (
    ErrorInfo,
    FrontClose,
    FrontDone,
    FrontInput,
    FrontOpened,
    FrontQuery,
    FrontSnapshot,
    PipelineRequest,
    ReplicaStats,
    RequestCounts,
)
from omnistage.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    ChatMessage,
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
    PeerConnector,
    Ping,
    Prompt,
    Ready,
    Redirect,
    Resume,
    Shutdown,
    Usage,
)
from omnistage.protocol.params import GenerationParams, SpeechParams, StageParams
from omnistage.protocol.registration import ErrorReply, RegisterReply
from omnistage.protocol.tags import TAGS

SAMPLES: dict[type, msgspec.Struct] = {
    Hello: Hello(stage_id=1, replica_id=2, epoch=3, pid=4321, host="node-a"),
    HandshakeInit: HandshakeInit(
        stage_config={"stage_id": 1, "name": "talker", "engine_args": {"num_chunks": 3}},
        input_address="tcp://10.0.0.1:5001",
        output_address="tcp://10.0.0.1:5002",
        coordinator_address="tcp://10.0.0.1:5003",
        heartbeat_interval_s=0.5,
        stage_init_timeout_s=120.0,
        error=None,
    ),
    Ready: Ready(
        stage_id=1,
        replica_id=2,
        epoch=3,
        capacity=64,
        engine="echo",
        pid=4321,
        address="tcp://10.0.0.9:7000",
    ),
    AddRequest: AddRequest(
        request_id="req-1",
        prompt=Prompt(messages=[ChatMessage("system", "be brief"), ChatMessage("user", "hi")]),
        upstream=[0, 2],
        params=StageParams(text=GenerationParams(temperature=0.7, max_tokens=16, stop=["\n"])),
        resume=Resume(text="Hello, wor", data_chunks=0, seq=3),
        attempt=2,
        peers=["tcp://10.0.0.9:7001"],
        head_all=False,
    ),
    Abort: Abort(request_id="req-9"),
    Redirect: Redirect(
        request_id="req-1",
        attempt=3,
        peers=["tcp://10.0.0.9:7002"],
        connectors=[PeerConnector("shm", {"segment_bytes": 1 << 20})],
        gone=["tcp://10.0.0.9:7001"],
    ),
    Shutdown: Shutdown(reason="head exiting"),
    HeartbeatAck: HeartbeatAck(
        state="UNKNOWN", head_instance="0123456789ab", heads=["10.0.0.1:5000", "10.0.0.2:5000"]
    ),
    HeadAnnounce: HeadAnnounce(
        master="10.0.0.2:5000", instance="ba9876543210", heads=["10.0.0.1:5000"]
    ),
    HeadAnnounceReply: HeadAnnounceReply(
        master="10.0.0.1:5000", instance="0123456789ab", heads=["10.0.0.2:5000"]
    ),
    HeadProbe: HeadProbe(stage_id=1, replica_id=3),
    HeadProbeReply: HeadProbeReply(head_instance="0123456789ab"),
    Ping: Ping(),
    OutputChunk: OutputChunk(
        request_id="req-1",
        stage_id=2,
        replica_id=0,
        epoch=7,
        seq=3,
        modality="text",
        text="héllo",
        data=b"\x01",
        finished=True,
        finish_reason="stop",
        error=None,
        usage=Usage(prompt_tokens=2, completion_tokens=5),
    ),
    Heartbeat: Heartbeat(
        stage_id=1,
        replica_id=2,
        epoch=3,
        status="UP",
        queue_length=4,
        in_flight=6,
        progress=100,
        seq=42,
    ),
    PipelineRequest: PipelineRequest(
        request_id="chatcmpl-1",
        prompt=Prompt(messages=[ChatMessage("user", "hi")]),
        finals=[0, 2],
        params=StageParams(text=GenerationParams(temperature=0.5)),
        stage_params={1: StageParams(speech=SpeechParams(voice="joe"))},
        only=False,
    ),
    FrontOpened: FrontOpened(
        request_id="chatcmpl-1",
        error=ErrorInfo(429, "stage 0 (x) is overloaded", "rate_limit_exceeded", None, "o"),
    ),
    FrontDone: FrontDone(request_id="chatcmpl-1", usage=Usage(prompt_tokens=3), error=None),
    FrontClose: FrontClose(request_id="chatcmpl-1"),
    FrontInput: FrontInput(request_id="rt-1", data=b"\x01\x00", last=True),
    InputChunk: InputChunk(request_id="rt-1", attempt=1, seq=3, data=b"\x01\x00", last=False),
    FrontQuery: FrontQuery(server=1, responses={200: 10, 429: 1}),
    FrontSnapshot: FrontSnapshot(
        missing=[(1, "talker")],
        status_json=b"{}",
        counts=RequestCounts(5, 1, 0, 2, 0),
        entries_json=b"[]",
        loads=[ReplicaStats(1, 0, True, 2, 8, 0, 41, "node-a")],
        waiting={0: 0},
        responses={0: {200: 10}},
    ),
}


def test_samples_cover_every_tagged_type():
    assert set(SAMPLES) == set(TAGS)


def test_tags_are_unique_single_bytes():
    tags = list(TAGS.values())
    assert len(set(tags)) == len(tags)
    assert all(isinstance(t, bytes) and len(t) == 1 for t in tags)


@pytest.mark.parametrize("cls", list(TAGS), ids=lambda c: c.__name__)
def test_tagged_message_round_trips(cls):
    msg = SAMPLES[cls]
    frames = codec.encode(msg)
    assert len(frames) == 2
    assert frames[0] == TAGS[cls]
    decoded = codec.decode_frames(frames)
    assert type(decoded) is cls
    assert decoded == msg


def test_prompt_with_text_round_trips_inside_add_request():
    msg = AddRequest(request_id="r", prompt=Prompt(text="plain"), upstream=[], params=StageParams())
    decoded = codec.decode(*codec.encode(msg))
    assert decoded.prompt.text == "plain"
    assert decoded.prompt.messages is None


def test_add_request_without_prompt_round_trips():
    msg = AddRequest(request_id="r", prompt=None, upstream=[0], params=StageParams())
    assert codec.decode(*codec.encode(msg)) == msg


def test_hello_defaults_to_current_protocol_version():
    decoded = codec.decode(*codec.encode(SAMPLES[Hello]))
    assert decoded.protocol_version == PROTOCOL_VERSION


def test_encoding_an_untagged_struct_raises_protocol_error():
    with pytest.raises(ProtocolError):
        codec.encode(ErrorReply(error="x"))


def test_decode_with_unknown_tag_raises_protocol_error():
    body = codec.encode(SAMPLES[Abort])[1]
    with pytest.raises(ProtocolError, match="unknown message tag"):
        codec.decode(b"Z", body)


def test_decode_with_empty_tag_raises_protocol_error():
    with pytest.raises(ProtocolError):
        codec.decode(b"", codec.encode(SAMPLES[Abort])[1])


def test_body_of_another_type_under_a_tag_raises_protocol_error():
    body = codec.encode(SAMPLES[Abort])[1]
    with pytest.raises(ProtocolError):
        codec.decode(TAGS[Heartbeat], body)


@pytest.mark.parametrize("cls", list(TAGS), ids=lambda c: c.__name__)
def test_every_truncation_of_a_body_raises_protocol_error(cls):
    tag, body = codec.encode(SAMPLES[cls])
    for cut in range(len(body)):
        with pytest.raises(ProtocolError):
            codec.decode(tag, body[:cut])


def test_garbage_bodies_raise_only_protocol_error():
    rng = random.Random(2024)
    for tag in TAGS.values():
        for _ in range(300):
            body = rng.randbytes(rng.randrange(1, 48))
            try:
                codec.decode(tag, body)
            except ProtocolError:
                pass


def test_trailing_bytes_after_a_body_raise_protocol_error():
    tag, body = codec.encode(SAMPLES[Shutdown])
    with pytest.raises(ProtocolError):
        codec.decode(tag, body + b"\x00")


def test_oversized_body_is_refused_unread(monkeypatch):
    monkeypatch.setattr(codec, "MAX_MESSAGE_BYTES", 8)
    tag, body = codec.encode(SAMPLES[Shutdown])
    assert len(body) > 8
    with pytest.raises(ProtocolError, match="exceeds"):
        codec.decode(tag, body)


@pytest.mark.parametrize("count", [0, 1, 3])
def test_wrong_frame_count_raises_protocol_error(count):
    tag, body = codec.encode(SAMPLES[Abort])
    frames = [tag, body, b""][:count]
    with pytest.raises(ProtocolError, match="expected 2 frames"):
        codec.decode_frames(frames)


# -- registration (seed msgpack maps) ----------------------------------------------------


def test_register_request_accepts_plain_map_with_seed_keys():
    body = msgspec.msgpack.encode(
        {
            "stage_id": 2,
            "replica_id": 1,
            "stage_config": {"engine": "echo"},
            "coordinator_input": "tcp://a:1",
            "coordinator_output": "tcp://a:2",
            "frontend_stats_publish_address": None,
            "replica_bind_address": "10.0.0.5",
            "replica_handshake_port": 7001,
            "replica_input_port": 7002,
            "replica_output_port": 7003,
            "replica_binds_sockets": True,
        }
    )
    req = codec.decode_register_request(body)
    assert (req.stage_id, req.replica_id) == (2, 1)
    assert req.stage_config == {"engine": "echo"}
    assert req.replica_bind_address == "10.0.0.5"
    assert (req.replica_handshake_port, req.replica_input_port, req.replica_output_port) == (
        7001,
        7002,
        7003,
    )
    assert req.replica_binds_sockets is True
    assert req.protocol_version is None


def test_register_request_with_only_stage_id_defaults_replica_id_to_zero():
    req = codec.decode_register_request(msgspec.msgpack.encode({"stage_id": 3}))
    assert (req.stage_id, req.replica_id) == (3, 0)


def test_register_request_ignores_unknown_keys():
    body = msgspec.msgpack.encode({"stage_id": 0, "replica_id": -1, "future_key": [1, 2]})
    req = codec.decode_register_request(body)
    assert (req.stage_id, req.replica_id) == (0, -1)


@pytest.mark.parametrize("stage_id", [-1, "1", 1.5, None])
def test_register_request_rejects_bad_stage_id(stage_id):
    body = msgspec.msgpack.encode({"stage_id": stage_id})
    with pytest.raises(ProtocolError, match="stage_id"):
        codec.decode_register_request(body)


def test_register_request_without_stage_id_is_rejected():
    with pytest.raises(ProtocolError, match="stage_id"):
        codec.decode_register_request(msgspec.msgpack.encode({"replica_id": 0}))


@pytest.mark.parametrize("body", [b"", b"\xc1", b"\x93\x01\x02\x03", b"\x82\xa8stage"])
def test_register_request_garbage_raises_protocol_error(body):
    with pytest.raises(ProtocolError):
        codec.decode_register_request(body)


def test_register_reply_round_trips():
    reply = RegisterReply(
        handshake_address="tcp://h:1",
        input_address="tcp://h:2",
        output_address="tcp://h:3",
        replica_id=4,
        coordinator_router_address=None,
        stage_id=1,
        epoch=9,
    )
    assert codec.decode_register_reply(codec.encode_register_reply(reply)) == reply


def test_register_reply_with_seed_keys_only_gets_extension_defaults():
    body = msgspec.msgpack.encode(
        {
            "handshake_address": "tcp://h:1",
            "input_address": "tcp://h:2",
            "output_address": "tcp://h:3",
            "replica_id": 0,
            "coordinator_router_address": "tcp://h:4",
        }
    )
    reply = codec.decode_register_reply(body)
    assert reply.coordinator_router_address == "tcp://h:4"
    assert (reply.stage_id, reply.epoch, reply.protocol_version) == (0, 0, PROTOCOL_VERSION)


def test_register_reply_error_map_becomes_protocol_error_with_its_text():
    with pytest.raises(ProtocolError) as info:
        codec.decode_register_reply(msgspec.msgpack.encode({"error": "x"}))
    assert str(info.value) == "x"


def test_encoded_error_reply_decodes_to_protocol_error():
    body = codec.encode_register_reply(ErrorReply(error="unknown stage_id 9"))
    with pytest.raises(ProtocolError, match="unknown stage_id 9"):
        codec.decode_register_reply(body)


@pytest.mark.parametrize(
    "body",
    [b"", b"\xc1", msgspec.msgpack.encode([1, 2]), msgspec.msgpack.encode({"replica_id": 1})],
    ids=["empty", "reserved-byte", "array", "missing-keys"],
)
def test_register_reply_garbage_raises_protocol_error(body):
    with pytest.raises(ProtocolError):
        codec.decode_register_reply(body)


def test_encode_raw_is_plain_msgpack():
    assert msgspec.msgpack.decode(codec.encode_raw({"a": [1, "b"]})) == {"a": [1, "b"]}


# -- deeply nested input (hostile peer) --------------------------------------------------

# 2,000 one-element msgpack arrays nested inside each other: about 2 KB on the wire.
DEEP = b"\x91" * 2000 + b"\xc0"
_enc = msgspec.msgpack.encode


def test_deeply_nested_add_request_params_raise_protocol_error():
    body = b"\x94" + _enc("r") + _enc(None) + _enc([]) + b"\x81" + _enc("k") + DEEP
    with pytest.raises(ProtocolError):
        codec.decode(TAGS[AddRequest], body)


def test_deeply_nested_register_request_raises_protocol_error():
    body = b"\x82" + _enc("stage_id") + _enc(0) + _enc("stage_config") + DEEP
    with pytest.raises(ProtocolError):
        codec.decode_register_request(body)


def test_deeply_nested_register_reply_raises_protocol_error():
    with pytest.raises(ProtocolError):
        codec.decode_register_reply(DEEP)
