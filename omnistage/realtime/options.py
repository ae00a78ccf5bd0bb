"""The objects a client configures a session and its answers with, as msgspec Structs:
``session.update``'s ``session`` (``SessionPatch``) and the parts ``response.create``
shares with it (tools, tool choice, output limits).

``decode`` converts a client's JSON into one of them in one pass; a refusal is one
``BadRequestError`` whose ``param`` names the field as OpenAI's ``error.param`` does
(``session.audio.input.turn_detection.threshold``, ``session.tools[1].name``). A patch
gives only what it changes: a field it leaves out is ``UNSET``.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import UNSET, Meta, UnsetType

from omnistage.protocol.errors import BadRequestError

# OpenAI's cap on max_output_tokens; "inf" means the model's own limit.
MAX_OUTPUT_TOKENS = 4096
MAX_INSTRUCTIONS = 32_768
MAX_TOOLS = 128


class SessionKind(enum.StrEnum):
    REALTIME = "realtime"
    TRANSCRIPTION = "transcription"


def bad(param: str, message: str, code: str = "invalid_value") -> BadRequestError:
    return BadRequestError(f"{param}: {message}" if param else message, param=param, code=code)


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A client object whose unknown fields are refused by name."""


class FunctionTool(msgspec.Struct, kw_only=True):
    """``{"type": "function", "name", "description", "parameters"}`` (other fields are
    ignored, as they always were)."""

    type: Literal["function"] | UnsetType = UNSET
    name: Annotated[str, Meta(min_length=1)]
    description: str | UnsetType = UNSET
    parameters: dict[str, Any] | UnsetType = UNSET  # a JSON schema


class FunctionChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    name: str


# OpenAI takes exactly one output modality: ["audio"] (with its transcript) or ["text"].
Modalities = Annotated[list[Literal["audio", "text"]], Meta(min_length=1, max_length=1)]
Tools = Annotated[list[FunctionTool], Meta(max_length=MAX_TOOLS)]
ToolChoice = Literal["auto", "none", "required"] | FunctionChoice
MaxTokens = Annotated[int, Meta(ge=1, le=MAX_OUTPUT_TOKENS)] | Literal["inf"] | None
Temperature = Annotated[float, Meta(ge=0, le=2)] | None
Voice = Annotated[str, Meta(min_length=1)]


class Transcription(_Strict):
    model: str | UnsetType | None = UNSET
    language: str | UnsetType | None = UNSET
    prompt: str | UnsetType | None = UNSET


class ServerVad(_Strict):
    """``turn_detection`` of type ``server_vad`` (the type may be left out): the server
    VAD's parameters (None: its default)."""

    type: Literal["server_vad"] = "server_vad"
    threshold: Annotated[float, Meta(ge=0, le=1)] | None = None
    prefix_padding_ms: Annotated[int, Meta(ge=0)] | None = None
    silence_duration_ms: Annotated[int, Meta(ge=0)] | None = None
    create_response: bool = True
    interrupt_response: bool = True
    resume_after_backchannel: bool = True  # ours: False cancels at once, as barge-in
    # Prompting a silent user is not built; accepting it would silently not act.
    idle_timeout_ms: None = None


class SemanticVad(_Strict):
    """``turn_detection: {"type": "semantic_vad", "eagerness"}``."""

    type: Literal["semantic_vad"]
    eagerness: Literal["low", "medium", "high", "auto"] = "auto"
    create_response: bool = True
    interrupt_response: bool = True
    resume_after_backchannel: bool = True


class InputAudio(_Strict):
    format: Any = UNSET  # checked by ``audio.formats.parse_audio_format``
    transcription: Transcription | UnsetType | None = UNSET
    # A ServerVad or a SemanticVad, told apart by "type" (``turn_detection_options``): a
    # server_vad object may leave its type out, which a tagged union does not allow.
    turn_detection: dict[str, Any] | UnsetType | None = UNSET
    noise_reduction: UnsetType | None = UNSET  # not built


class OutputAudio(_Strict):
    format: Any = UNSET
    voice: Voice | UnsetType = UNSET
    speed: Annotated[float, Meta(ge=0.25, le=1.5)] | UnsetType = UNSET


class SessionAudio(_Strict):
    input: InputAudio | UnsetType = UNSET
    output: OutputAudio | UnsetType = UNSET


class SessionPatch(_Strict):
    """``session.update``'s ``session``: what it changes."""

    type: SessionKind | UnsetType = UNSET
    model: str | UnsetType = UNSET
    instructions: Annotated[str, Meta(max_length=MAX_INSTRUCTIONS)] | UnsetType = UNSET
    output_modalities: Modalities | UnsetType = UNSET
    audio: SessionAudio | UnsetType = UNSET
    tools: Tools | UnsetType = UNSET
    tool_choice: ToolChoice | UnsetType = UNSET
    max_output_tokens: MaxTokens | UnsetType = UNSET
    temperature: Temperature | UnsetType = UNSET
    # Accepted and not acted on: what OpenAI's SDKs send back from session.created.
    object: Any = UNSET
    id: Any = UNSET
    expires_at: Any = UNSET
    include: Any = UNSET
    tracing: Any = UNSET
    truncation: Any = UNSET
    prompt: Any = UNSET


T = TypeVar("T")

# Refused as a whole: a value inside them is no parameter of its own.
_WHOLE = ("tool_choice", "output_modalities")
# Parameters OpenAI has that this server does not act on: only null is accepted.
_UNSUPPORTED = ("noise_reduction", "idle_timeout_ms")


def decode(value: Any, kind: type[T], where: str) -> T:
    """``value`` as ``kind``; a refusal names its param under ``where``."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        raise refusal(str(exc), where) from None


def refusal(why: str, where: str) -> BadRequestError:
    """msgspec's "Expected `int`, got `str` - at `$.tools[0].name`" as an error naming
    ``where.tools[0].name``."""
    message, _, path = why.partition(" - at `$")
    param = where + path.rstrip("`")
    code = "invalid_value"
    field = message.split("`")[1] if "`" in message else ""
    if message.startswith("Object contains unknown field"):
        param, message, code = f"{param}.{field}", "unknown parameter", "unknown_parameter"
    elif message.startswith("Object missing required field"):
        param = f"{param}.{field}"
    for name in _WHOLE:
        whole = f"{where}.{name}"
        if param.startswith((f"{whole}.", f"{whole}[")):
            param = whole
    if param.rpartition(".")[2] in _UNSUPPORTED:
        message = "not supported; use null"
    return bad(param, message, code)


def turn_detection_options(value: dict[str, Any], where: str) -> ServerVad | SemanticVad:
    if value.get("type") == "semantic_vad":
        return decode(value, SemanticVad, where)
    return decode(value, ServerVad, where)


def tool_dicts(tools: list[FunctionTool]) -> list[dict[str, Any]]:
    """The tools as given (the fields they set), as the session echoes them."""
    return msgspec.to_builtins(tools)  # type: ignore[no-any-return]


def tool_choice_value(choice: ToolChoice) -> str | dict[str, Any]:
    return msgspec.to_builtins(choice)  # type: ignore[no-any-return]


def max_tokens_value(value: int | str | None) -> int | None:
    """``max_output_tokens``: None is "inf", the model's own limit."""
    return value if isinstance(value, int) else None


class ResponseAudioOutput(_Strict):
    format: Any = UNSET
    voice: Voice | UnsetType = UNSET


class ResponseParams(_Strict):
    """``response.create``'s ``response``: what differs from the session for one answer."""

    conversation: Literal["auto", "none"] = "auto"
    output_modalities: Modalities | UnsetType = UNSET
    tools: Tools | UnsetType = UNSET
    tool_choice: ToolChoice | UnsetType = UNSET
    max_output_tokens: MaxTokens | UnsetType = UNSET
    temperature: Temperature | UnsetType = UNSET  # null: the session's
    metadata: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None  # {"output": ResponseAudioOutput}
    prompt: Any = UNSET  # accepted, not acted on
    # Read by the session itself: which items the answer hears, and its instructions.
    input: Any = UNSET
    instructions: str | UnsetType = UNSET
