"""The Realtime API's client events, decoded into typed structs, and the server events'
common shape.

Client events are one msgspec union tagged by ``type``: a frame decodes in one pass, an
unknown ``type`` or a field of the wrong type is one ``BadRequestError`` naming the field
(``audio``, ``item.type``), and the session answers it with an ``error`` event and goes
on. Objects with many optional parts (a session patch, an item, a response's settings)
stay plain JSON here and are checked by their owners (``config``, ``items``).
"""

from __future__ import annotations

import itertools
from typing import Any

import msgspec

from omnistage.protocol.errors import BadRequestError

# The largest event a client may send (OpenAI's limit on one WebSocket message).
MAX_EVENT_BYTES = 15 * 1024 * 1024


class ClientEvent(msgspec.Struct, tag_field="type", kw_only=True):
    event_id: str | None = None


class SessionUpdate(ClientEvent, tag="session.update"):
    session: dict[str, Any]


class AudioAppend(ClientEvent, tag="input_audio_buffer.append"):
    audio: str  # base64 of audio in the session's input format


class AudioCommit(ClientEvent, tag="input_audio_buffer.commit"):
    pass


class AudioClear(ClientEvent, tag="input_audio_buffer.clear"):
    pass


class ItemCreate(ClientEvent, tag="conversation.item.create"):
    item: dict[str, Any]
    previous_item_id: str | None = None


class ItemDelete(ClientEvent, tag="conversation.item.delete"):
    item_id: str


class ItemRetrieve(ClientEvent, tag="conversation.item.retrieve"):
    item_id: str


class ItemTruncate(ClientEvent, tag="conversation.item.truncate"):
    item_id: str
    audio_end_ms: int
    content_index: int = 0


class ResponseCreate(ClientEvent, tag="response.create"):
    response: dict[str, Any] | None = None


class ResponseCancel(ClientEvent, tag="response.cancel"):
    response_id: str | None = None


class OutputAudioClear(ClientEvent, tag="output_audio_buffer.clear"):
    pass


AnyClientEvent = (
    SessionUpdate
    | AudioAppend
    | AudioCommit
    | AudioClear
    | ItemCreate
    | ItemDelete
    | ItemRetrieve
    | ItemTruncate
    | ResponseCreate
    | ResponseCancel
    | OutputAudioClear
)
CLIENT_EVENT_TYPES = tuple(
    c.__struct_config__.tag
    for c in AnyClientEvent.__args__  # type: ignore[attr-defined]
)
_decoder = msgspec.json.Decoder(AnyClientEvent)
_loose = msgspec.json.Decoder(dict[str, Any])


def decode_client_event(frame: str | bytes) -> AnyClientEvent:
    """One client frame as its event; a malformed one raises ``BadRequestError`` naming
    the field, with ``event_id`` set when the frame had one."""
    try:
        return _decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise _refusal(frame, str(exc)) from None
    except msgspec.DecodeError:
        raise BadRequestError(
            "The event is not valid JSON", param=None, code="invalid_json"
        ) from None


def _refusal(frame: str | bytes, why: str) -> BadRequestError:
    try:
        event = _loose.decode(frame)
    except msgspec.ValidationError:
        return BadRequestError("An event must be a JSON object", code="invalid_value")
    kind = event.get("type")
    if (
        why.startswith("Object missing required field `type`")
        or (isinstance(kind, str) and kind not in CLIENT_EVENT_TYPES)
        or not isinstance(kind, str)
    ):
        err = BadRequestError(
            f"Invalid value: {kind!r}. Supported values are: {', '.join(CLIENT_EVENT_TYPES)}.",
            param="type",
            code="invalid_value",
        )
    else:
        # msgspec says "Expected `str`, got `int` - at `$.audio`": the path is the param.
        message, _, path = why.partition(" - at `$.")
        param = path.rstrip("`") or _missing_field(message)
        err = BadRequestError(f"{message} ({kind})", param=param, code="invalid_value")
    event_id = event.get("event_id")
    err.event_id = event_id if isinstance(event_id, str) else None  # type: ignore[attr-defined]
    return err


def _missing_field(message: str) -> str | None:
    # "Object missing required field `audio`"
    if "missing required field `" in message:
        return message.split("`")[1]
    return None


class EventIds:
    """Server event ids, unique within a session."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "event_id": f"event_{next(self._next)}", **fields}


def error_fields(exc: BadRequestError, event_id: str | None = None) -> dict[str, Any]:
    """The ``error`` object of an ``error`` event, from a refused client event."""
    return {
        "type": "invalid_request_error",
        "code": exc.code or "invalid_value",
        "message": str(exc),
        "param": exc.param,
        "event_id": event_id or getattr(exc, "event_id", None),
    }
