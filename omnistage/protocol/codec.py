"""Encoding and decoding of wire messages; never pickle."""

from __future__ import annotations

import base64
from typing import Any, Protocol, TypeVar

import msgspec

from omnistage.protocol.auth import AuthStamp, Signer, Verifier, decode_stamp, encode_stamp
from omnistage.protocol.errors import IdConflict, ProtocolError, Redirected
from omnistage.protocol.registration import (
    ErrorReply,
    RegisterRedirect,
    RegisterReply,
    RegisterRequest,
)
from omnistage.protocol.tags import TAGS

T = TypeVar("T", bound=msgspec.Struct)

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[bytes, msgspec.msgpack.Decoder[Any]] = {
    tag: msgspec.msgpack.Decoder(cls) for cls, tag in TAGS.items()
}
_register_request_decoder = msgspec.msgpack.Decoder(RegisterRequest)
_raw_decoder = msgspec.msgpack.Decoder()

# A registration or a tagged body larger than this is refused unread (hostile peers).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


# A hostile peer can nest containers deep enough to exhaust the decoder's recursion;
# that is bad input like any other, never a crash.
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


def _why(exc: BaseException) -> str:
    return "nested too deeply" if isinstance(exc, RecursionError) else str(exc)


def encode(msg: msgspec.Struct) -> list[bytes]:
    """Return the ``[tag, body]`` frames of a tagged message."""
    try:
        tag = TAGS[type(msg)]
    except KeyError:
        raise ProtocolError(f"{type(msg).__name__} is not a tagged wire message") from None
    return [tag, _encoder.encode(msg)]


def decode(tag: bytes, body: bytes) -> Any:
    """Decode a tagged body, checking the tag before touching the body."""
    decoder = _decoders.get(bytes(tag))
    if decoder is None:
        raise ProtocolError(f"unknown message tag {bytes(tag)[:8]!r}")
    if len(body) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return decoder.decode(body)
    except _DECODE_ERRORS as exc:
        raise ProtocolError(f"invalid {decoder.type.__name__}: {_why(exc)}") from None


def decode_frames(frames: list[bytes]) -> Any:
    """Decode ``[tag, body]``; anything else is a ProtocolError."""
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames (tag, body), got {len(frames)}")
    return decode(frames[0], frames[1])


_LEN = 4  # bytes of a record's body length


def pack(msg: msgspec.Struct) -> bytes:
    """One record of a data-plane batch: tag, 4-byte little-endian body length, body.

    The data plane (requests, outputs, the API servers' link) sends each batch as one
    ZMQ frame of records: a frame costs pyzmq a few microseconds to send and as much to
    receive, far more than slicing records out of one.
    """
    tag, body = encode(msg)
    return tag + len(body).to_bytes(_LEN, "little") + body


def unpack(blob: bytes) -> list[tuple[bytes, memoryview]]:
    """Split a batch frame into ``(tag, body)`` records; malformed framing is a
    ProtocolError (the bodies are not decoded here)."""
    view = memoryview(blob)
    out: list[tuple[bytes, memoryview]] = []
    at, end = 0, len(view)
    if not end:
        raise ProtocolError("empty batch")
    while at < end:
        if end - at < 1 + _LEN:
            raise ProtocolError("truncated record header in a batch")
        size = int.from_bytes(view[at + 1 : at + 1 + _LEN], "little")
        start = at + 1 + _LEN
        if size > MAX_MESSAGE_BYTES or start + size > end:
            raise ProtocolError(f"record of {size} bytes overruns its batch")
        out.append((bytes(view[at : at + 1]), view[start : start + size]))
        at = start + size
    return out


def decode_batch(frames: list[bytes]) -> list[Any]:
    """Decode a data-plane message: one frame of records made by ``pack``.

    Each record is checked on its own; one bad record fails the whole batch, since a
    peer that sends garbage cannot be trusted for the rest of that message either.
    """
    if len(frames) != 1:
        raise ProtocolError(f"expected one batch frame, got {len(frames)} frames")
    return [decode(tag, body) for tag, body in unpack(frames[0])]


class _Warns(Protocol):
    def warning(self, msg: str, *args: object) -> None: ...


def decode_batch_or_drop(frames: list[bytes], log: _Warns, source: str) -> list[Any]:
    """``decode_batch``, or nothing (and a warning naming ``source``) for a bad batch: a
    receiving loop drops what it cannot read and goes on."""
    try:
        return decode_batch(frames)
    except ProtocolError as exc:
        log.warning("dropped a bad message %s: %s", source, exc)
        return []


def decode_records(blob: bytes, tag: bytes, decoder: msgspec.msgpack.Decoder[T]) -> list[T]:
    """The hot path for a batch of one message type: every record must carry ``tag``,
    each body is decoded by ``decoder``."""
    records = unpack(blob)
    if any(t != tag for t, _ in records):
        raise ProtocolError(f"a batch of {decoder.type.__name__} holds another message")
    try:
        return [decoder.decode(body) for _, body in records]
    except _DECODE_ERRORS as exc:
        raise ProtocolError(f"invalid {decoder.type.__name__}: {_why(exc)}") from None


def encode_blob(msg: msgspec.Struct) -> str:
    """A struct as printable text, for an environment variable (a child's options)."""
    return base64.b64encode(_encoder.encode(msg)).decode("ascii")


def decode_blob(blob: str, type_: type[T]) -> T:
    """The struct ``encode_blob`` made; ProtocolError for anything else."""
    try:
        return msgspec.msgpack.decode(base64.b64decode(blob, validate=True), type=type_)
    except (*_DECODE_ERRORS, ValueError) as exc:
        raise ProtocolError(f"invalid {type_.__name__}: {_why(exc)}") from None


def decode_register_request(body: bytes, verifier: Verifier | None = None) -> RegisterRequest:
    """Decode a registration; with a verifier, its ``auth`` stamp must check out."""
    if len(body) > MAX_MESSAGE_BYTES:
        raise ProtocolError("registration message too large")
    if verifier is None:
        try:
            return _register_request_decoder.decode(body)
        except _DECODE_ERRORS as exc:
            raise ProtocolError(f"invalid registration: {_why(exc)}") from None
    try:
        raw = _raw_decoder.decode(body)
    except _DECODE_ERRORS as exc:
        raise ProtocolError(f"invalid registration: {_why(exc)}") from None
    if not isinstance(raw, dict):
        raise ProtocolError("invalid registration: expected a map")
    stamp_raw = raw.pop("auth", None)
    try:
        stamp = msgspec.convert(stamp_raw, AuthStamp) if stamp_raw is not None else None
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"bad authentication stamp: {exc}") from None
    verifier.check(_encoder.encode(raw), stamp)
    try:
        return msgspec.convert(raw, RegisterRequest)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid registration: {exc}") from None


def encode_register_request(payload: dict[str, Any], signer: Signer | None = None) -> bytes:
    """The registration map, stamped when a signer is given (the MAC covers the map
    without its ``auth`` key, as the master re-encodes it)."""
    if signer is None:
        return _encoder.encode(payload)
    stamp = signer.stamp(_encoder.encode(payload))
    return _encoder.encode({**payload, "auth": stamp})


def split_signed(frames: list[bytes]) -> tuple[list[bytes], bytes | None]:
    """``[tag, body]`` or ``[tag, body, stamp]`` -> (message frames, stamp frame)."""
    if len(frames) == 3:
        return frames[:2], frames[2]
    return frames, None


def check_signed(frames: list[bytes], stamp_frame: bytes | None, verifier: Verifier | None) -> None:
    """Verify a tagged message's stamp (MAC over tag and body) when auth is on."""
    if verifier is None:
        return
    stamp = decode_stamp(stamp_frame) if stamp_frame is not None else None
    verifier.check(b"".join(frames), stamp)


def decode_signed(frames: list[bytes], verifier: Verifier | None, kind: type[T]) -> T:
    """A control message ``[tag, body(, stamp)]``: its stamp checked when auth is on,
    decoded, and of type ``kind``; else a ProtocolError."""
    message, stamp = split_signed(frames)
    check_signed(message, stamp, verifier)
    msg = decode_frames(message)
    if not isinstance(msg, kind):
        raise ProtocolError(f"expected {kind.__name__}, got {type(msg).__name__}")
    return msg


def sign(frames: list[bytes], signer: Signer | None) -> list[bytes]:
    if signer is None:
        return frames
    return [*frames, encode_stamp(signer.stamp(b"".join(frames)))]


def encode_register_reply(reply: RegisterReply | RegisterRedirect | ErrorReply) -> bytes:
    return _encoder.encode(reply)


def decode_register_reply(body: bytes) -> RegisterReply:
    """Decode the master's reply; an error reply becomes a ProtocolError with its text
    (an ``IdConflict`` when it names the replica holding the id asked for), a redirect
    a ``Redirected``."""
    try:
        raw = _raw_decoder.decode(body)
    except _DECODE_ERRORS as exc:
        raise ProtocolError(f"undecodable registration reply: {_why(exc)}") from None
    if isinstance(raw, dict) and "error" in raw:
        if isinstance(raw.get("held_by"), str):
            raise IdConflict(str(raw["error"]), raw["held_by"])
        raise ProtocolError(str(raw["error"]))
    if isinstance(raw, dict) and "redirect" in raw:
        try:
            redirect = msgspec.convert(raw, RegisterRedirect)
        except msgspec.ValidationError as exc:
            raise ProtocolError(f"invalid registration redirect: {exc}") from None
        raise Redirected(redirect.redirect, redirect.head_instance)
    try:
        return msgspec.convert(raw, RegisterReply)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid registration reply: {exc}") from None


def encode_raw(obj: Any) -> bytes:
    """Encode builtins (maps, lists, scalars) as msgpack."""
    return _encoder.encode(obj)
