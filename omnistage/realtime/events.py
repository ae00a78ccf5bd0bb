"""The Realtime API's events as typed structs: the client's, decoded, and the server's,
encoded; each a msgspec union tagged by ``type`` with OpenAI's GA event names.

Client events: a frame decodes in one pass, an unknown ``type`` or a field of the wrong
type is one ``BadRequestError`` naming the field (``audio``, ``item.type``), and the
session answers it with an ``error`` event and goes on. Objects with many optional parts
(a session patch, an item, a response's settings) stay plain JSON here and are checked by
their owners (``config``, ``conversation``, ``replies``).

Server events: the session gives each its ``event_id`` as it sends it. The objects they
carry (an item, a response, a session) are the JSON their owners keep, in OpenAI's shape.
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


# --------------------------------------------------------------------------------------
# Server events
# --------------------------------------------------------------------------------------


class ServerEvent(msgspec.Struct, tag_field="type", kw_only=True):
    event_id: str = ""  # set by the session as it sends the event


class Failure(msgspec.Struct):
    """What went wrong: a failed transcription's ``error``."""

    type: str
    code: str
    message: str
    param: str | None = None


class ErrorDetails(Failure):
    """An ``error`` event's ``error``: also which client event it refuses."""

    event_id: str | None = None


class Error(ServerEvent, tag="error", kw_only=True):
    error: ErrorDetails


class SessionCreated(ServerEvent, tag="session.created", kw_only=True):
    session: dict[str, Any]
    # Ours (session resume): {"token", "resumed", "expires_in"}, where sessions are saved.
    resume: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


class SessionUpdated(ServerEvent, tag="session.updated", kw_only=True):
    session: dict[str, Any]


class InputCleared(ServerEvent, tag="input_audio_buffer.cleared", kw_only=True):
    pass


class InputCommitted(ServerEvent, tag="input_audio_buffer.committed", kw_only=True):
    previous_item_id: str | None
    item_id: str


class InputSpeechStarted(ServerEvent, tag="input_audio_buffer.speech_started", kw_only=True):
    audio_start_ms: int
    item_id: str


class InputSpeechStopped(ServerEvent, tag="input_audio_buffer.speech_stopped", kw_only=True):
    audio_end_ms: int
    item_id: str


class ItemAdded(ServerEvent, tag="conversation.item.added", kw_only=True):
    previous_item_id: str | None
    item: dict[str, Any]


class ItemDone(ServerEvent, tag="conversation.item.done", kw_only=True):
    previous_item_id: str | None
    item: dict[str, Any]


class ItemRetrieved(ServerEvent, tag="conversation.item.retrieved", kw_only=True):
    item: dict[str, Any]


class ItemDeleted(ServerEvent, tag="conversation.item.deleted", kw_only=True):
    item_id: str


class ItemTruncated(ServerEvent, tag="conversation.item.truncated", kw_only=True):
    item_id: str
    content_index: int
    audio_end_ms: int


_TRANSCRIPTION = "conversation.item.input_audio_transcription"


class _TranscriptionEvent(ServerEvent, kw_only=True):
    item_id: str
    content_index: int = 0


class TranscriptionDelta(_TranscriptionEvent, tag=f"{_TRANSCRIPTION}.delta", kw_only=True):
    delta: str


class TranscriptionCompleted(_TranscriptionEvent, tag=f"{_TRANSCRIPTION}.completed", kw_only=True):
    transcript: str


class TranscriptionFailed(_TranscriptionEvent, tag=f"{_TRANSCRIPTION}.failed", kw_only=True):
    error: Failure


class ResponseCreated(ServerEvent, tag="response.created", kw_only=True):
    response: dict[str, Any]


class ResponseDone(ServerEvent, tag="response.done", kw_only=True):
    response: dict[str, Any]


class RateLimitsUpdated(ServerEvent, tag="rate_limits.updated", kw_only=True):
    rate_limits: list[dict[str, Any]]


class _ResponseEvent(ServerEvent, kw_only=True):
    response_id: str


class OutputItemAdded(_ResponseEvent, tag="response.output_item.added", kw_only=True):
    output_index: int
    item: dict[str, Any]


class OutputItemDone(_ResponseEvent, tag="response.output_item.done", kw_only=True):
    output_index: int
    item: dict[str, Any]


class PartEvent(_ResponseEvent, kw_only=True):
    """An event of the answer message's one content part."""

    item_id: str
    output_index: int
    content_index: int = 0


class ContentPartAdded(PartEvent, tag="response.content_part.added", kw_only=True):
    part: dict[str, Any]


class ContentPartDone(PartEvent, tag="response.content_part.done", kw_only=True):
    part: dict[str, Any]


class OutputTextDelta(PartEvent, tag="response.output_text.delta", kw_only=True):
    delta: str


class OutputTextDone(PartEvent, tag="response.output_text.done", kw_only=True):
    text: str


class OutputAudioDelta(PartEvent, tag="response.output_audio.delta", kw_only=True):
    delta: str  # base64 of audio in the session's output format


class OutputAudioDone(PartEvent, tag="response.output_audio.done", kw_only=True):
    pass


class _OutputBufferEvent(ServerEvent, kw_only=True):
    """WebRTC only: the call's outgoing track started, stopped or was cleared of an
    answer's audio (which the data channel does not carry)."""

    response_id: str


class OutputBufferStarted(_OutputBufferEvent, tag="output_audio_buffer.started", kw_only=True):
    pass


class OutputBufferStopped(_OutputBufferEvent, tag="output_audio_buffer.stopped", kw_only=True):
    pass


class OutputBufferCleared(_OutputBufferEvent, tag="output_audio_buffer.cleared", kw_only=True):
    pass


class TranscriptDelta(PartEvent, tag="response.output_audio_transcript.delta", kw_only=True):
    delta: str


class TranscriptDone(PartEvent, tag="response.output_audio_transcript.done", kw_only=True):
    transcript: str


class _CallEvent(_ResponseEvent, kw_only=True):
    item_id: str
    output_index: int
    call_id: str


class CallArgumentsDelta(_CallEvent, tag="response.function_call_arguments.delta", kw_only=True):
    delta: str


class CallArgumentsDone(_CallEvent, tag="response.function_call_arguments.done", kw_only=True):
    name: str
    arguments: str


AnyServerEvent = (
    Error
    | SessionCreated
    | SessionUpdated
    | InputCleared
    | InputCommitted
    | InputSpeechStarted
    | InputSpeechStopped
    | ItemAdded
    | ItemDone
    | ItemRetrieved
    | ItemDeleted
    | ItemTruncated
    | TranscriptionDelta
    | TranscriptionCompleted
    | TranscriptionFailed
    | ResponseCreated
    | ResponseDone
    | RateLimitsUpdated
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputTextDelta
    | OutputTextDone
    | OutputAudioDelta
    | OutputAudioDone
    | OutputBufferStarted
    | OutputBufferStopped
    | OutputBufferCleared
    | TranscriptDelta
    | TranscriptDone
    | CallArgumentsDelta
    | CallArgumentsDone
)
SERVER_EVENT_TYPES = tuple(
    c.__struct_config__.tag
    for c in AnyServerEvent.__args__  # type: ignore[attr-defined]
)


class EventIds:
    """Server event ids, unique within a session."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def next(self) -> str:
        return f"event_{next(self._next)}"


def error_event(exc: BadRequestError, event_id: str | None = None) -> Error:
    """The ``error`` event for a refused client event (``event_id``: the caller's, else
    the one the refused frame had)."""
    details = ErrorDetails(
        type="invalid_request_error",
        code=exc.code or "invalid_value",
        message=str(exc),
        param=exc.param,
        event_id=event_id or getattr(exc, "event_id", None),
    )
    return Error(error=details)
