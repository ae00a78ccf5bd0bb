"""Property tests: no byte string makes a decoder raise anything but ProtocolError."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnistage.protocol import codec
from omnistage.protocol.errors import ProtocolError
from omnistage.protocol.messages import Abort, OutputChunk
from omnistage.protocol.registration import RegisterRequest
from omnistage.protocol.tags import TAGS

TAG_BYTES = st.sampled_from([*TAGS.values(), b"", b"?", b"OO"])
# msgpack-shaped noise: valid containers of wrong types, plus raw bytes.
MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text()
    | st.binary(),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(tag=TAG_BYTES, body=st.binary(max_size=256))
def test_random_bytes_only_ever_raise_protocol_error(tag: bytes, body: bytes) -> None:
    try:
        codec.decode(tag, body)
    except ProtocolError:
        pass


@settings(max_examples=400, deadline=None)
@given(tag=TAG_BYTES, value=MSGPACK_VALUES)
def test_well_formed_msgpack_of_the_wrong_shape_is_a_protocol_error(tag: bytes, value) -> None:
    try:
        codec.decode(tag, msgspec.msgpack.encode(value))
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(value=MSGPACK_VALUES)
def test_registration_decoder_never_crashes(value) -> None:
    try:
        req = codec.decode_register_request(msgspec.msgpack.encode(value))
    except ProtocolError:
        return
    assert isinstance(req, RegisterRequest) and req.stage_id >= 0


@settings(max_examples=200, deadline=None)
@given(frames=st.lists(st.binary(max_size=64), max_size=7))
def test_batches_of_any_frames_only_raise_protocol_error(frames: list[bytes]) -> None:
    try:
        codec.decode_batch(frames)
    except ProtocolError:
        pass


@given(
    text=st.text(),
    data=st.binary(max_size=64),
    seq=st.integers(min_value=0, max_value=2**31),
    finished=st.booleans(),
)
def test_output_chunks_round_trip(text: str, data: bytes, seq: int, finished: bool) -> None:
    chunk = OutputChunk("r", 1, 2, 3, seq, "text", text=text, data=data, finished=finished)
    (again,) = codec.decode_batch([codec.pack(chunk)])
    assert again == chunk


@settings(max_examples=200, deadline=None)
@given(blob=st.binary(max_size=200))
def test_batch_frames_of_any_bytes_only_raise_protocol_error(blob: bytes) -> None:
    try:
        codec.decode_batch([blob])
    except ProtocolError:
        pass


def test_a_batch_holds_its_records_in_order_and_refuses_a_cut_or_a_stranger() -> None:
    chunks = [OutputChunk("r", 0, 0, 1, i, "text", text=str(i) * i) for i in range(5)]
    blob = b"".join(codec.pack(c) for c in chunks)
    assert codec.decode_batch([blob]) == chunks
    tag, decoder = codec.TAGS[OutputChunk], msgspec.msgpack.Decoder(OutputChunk)
    assert codec.decode_records(blob, tag, decoder) == chunks
    for cut in (1, 4, len(blob) - 1):
        with pytest.raises(ProtocolError):
            codec.decode_batch([blob[:cut]])
    with pytest.raises(ProtocolError):  # an Abort among the outputs
        codec.decode_records(blob + codec.pack(Abort("r")), tag, decoder)


def test_truncated_messages_never_decode() -> None:
    body = codec.encode(OutputChunk("req", 0, 0, 1, 0, "text", text="hello"))[1]
    for cut in range(len(body)):
        with pytest.raises(ProtocolError):
            codec.decode(codec.TAGS[OutputChunk], body[:cut])
