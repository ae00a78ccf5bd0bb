"""A Realtime session's configuration: what ``session.update`` sets and
``session.created``/``session.updated`` echo, in OpenAI's GA shape.

``SessionConfig.update`` checks a whole patch before it changes anything, so a bad
update leaves the session as it was; every error names the field it refuses
(``session.audio.input.turn_detection.threshold``), as OpenAI's ``error.param`` does.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from omnistage.audio.formats import PCM, AudioFormat, AudioFormatError, parse_audio_format
from omnistage.audio.server_vad import ServerVadParams
from omnistage.protocol.errors import BadRequestError

REALTIME, TRANSCRIPTION = "realtime", "transcription"
MODALITIES = ("audio", "text")
TOOL_CHOICES = ("auto", "none", "required")
# OpenAI's cap on max_output_tokens; "inf" means the model's own limit.
MAX_OUTPUT_TOKENS = 4096
MAX_INSTRUCTIONS = 32_768
MAX_TOOLS = 128
DEFAULT_INSTRUCTIONS = (
    "You are a helpful voice assistant. Answer briefly, in one or two short spoken "
    "sentences, without lists or markdown."
)


def bad(param: str, message: str, code: str = "invalid_value") -> BadRequestError:
    return BadRequestError(f"{param}: {message}" if param else message, param=param, code=code)


@dataclass(frozen=True, slots=True)
class TurnDetection:
    """``turn_detection: {"type": "server_vad", ...}``; None on the session is push-to-talk."""

    vad: ServerVadParams = field(default_factory=ServerVadParams)
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "server_vad",
            "threshold": self.vad.threshold,
            "prefix_padding_ms": self.vad.prefix_padding_ms,
            "silence_duration_ms": self.vad.silence_duration_ms,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
            "idle_timeout_ms": self.idle_timeout_ms,
        }


@dataclass(slots=True)
class SessionConfig:
    kind: str = REALTIME
    model: str = ""
    instructions: str = DEFAULT_INSTRUCTIONS
    output_modalities: tuple[str, ...] = ("audio",)
    input_format: AudioFormat = PCM
    output_format: AudioFormat = PCM
    voice: str = "alloy"
    speed: float = 1.0
    # ``audio.input.transcription`` as given ({"model": ..., "language": ..., "prompt":
    # ...}); None: user audio is not transcribed for the client (the thinker still
    # hears it through the listener).
    transcription: dict[str, Any] | None = None
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    max_output_tokens: int | None = None  # None: "inf"
    temperature: float | None = None

    def update(self, patch: Any) -> None:
        """Apply a ``session.update``'s ``session`` object, all of it or nothing."""
        if not isinstance(patch, Mapping):
            raise bad("session", "expected an object")
        new = copy.copy(self)
        for key, value in patch.items():
            setter = _SETTERS.get(key)
            if setter is None:
                if key in _IGNORED:
                    continue
                raise bad(f"session.{key}", "unknown parameter", "unknown_parameter")
            setter(new, value)
        for name in self.__slots__:  # type: ignore[attr-defined]
            setattr(self, name, getattr(new, name))

    def to_json(self, session_id: str, expires_at: int) -> dict[str, Any]:
        audio_in: dict[str, Any] = {
            "format": self.input_format.to_json(),
            "transcription": self.transcription,
            "noise_reduction": None,
            "turn_detection": self.turn_detection.to_json() if self.turn_detection else None,
        }
        out: dict[str, Any] = {
            "type": self.kind,
            "object": f"{self.kind}.session",
            "id": session_id,
            "expires_at": expires_at,
            "include": None,
        }
        if self.kind == TRANSCRIPTION:
            out["audio"] = {"input": audio_in}
            return out
        out.update(
            model=self.model,
            output_modalities=list(self.output_modalities),
            instructions=self.instructions,
            tools=self.tools,
            tool_choice=self.tool_choice,
            max_output_tokens=self.max_output_tokens or "inf",
            tracing=None,
            truncation="auto",
            prompt=None,
            audio={
                "input": audio_in,
                "output": {
                    "format": self.output_format.to_json(),
                    "voice": self.voice,
                    "speed": self.speed,
                },
            },
        )
        return out


# --------------------------------------------------------------------------------------
# Field setters: each checks one field of the patch and sets it on the copy.
# --------------------------------------------------------------------------------------


def _type(cfg: SessionConfig, value: Any) -> None:
    if value not in (REALTIME, TRANSCRIPTION):
        raise bad("session.type", f"expected 'realtime' or 'transcription', got {value!r}")
    cfg.kind = value


def _model(cfg: SessionConfig, value: Any) -> None:
    if not isinstance(value, str):
        raise bad("session.model", "expected a string")
    cfg.model = value


def _instructions(cfg: SessionConfig, value: Any) -> None:
    if not isinstance(value, str) or len(value) > MAX_INSTRUCTIONS:
        raise bad("session.instructions", f"expected a string of at most {MAX_INSTRUCTIONS}")
    cfg.instructions = value


def _modalities(cfg: SessionConfig, value: Any) -> None:
    # OpenAI takes exactly one: ["audio"] (with its transcript) or ["text"].
    if not isinstance(value, list) or len(value) != 1 or value[0] not in MODALITIES:
        raise bad("session.output_modalities", 'expected ["audio"] or ["text"]')
    cfg.output_modalities = tuple(value)


def _audio(cfg: SessionConfig, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise bad("session.audio", "expected an object")
    for key, part in value.items():
        if key == "input":
            _audio_input(cfg, part)
        elif key == "output":
            _audio_output(cfg, part)
        else:
            raise bad(f"session.audio.{key}", "unknown parameter", "unknown_parameter")


def _audio_input(cfg: SessionConfig, value: Any) -> None:
    where = "session.audio.input"
    if not isinstance(value, Mapping):
        raise bad(where, "expected an object")
    for key, part in value.items():
        if key == "format":
            cfg.input_format = _format(part, f"{where}.format")
        elif key == "transcription":
            cfg.transcription = _transcription(part, f"{where}.transcription")
        elif key == "turn_detection":
            cfg.turn_detection = _turn_detection(part, f"{where}.turn_detection")
        elif key == "noise_reduction":
            if part is not None:
                raise bad(f"{where}.noise_reduction", "not supported; use null")
        else:
            raise bad(f"{where}.{key}", "unknown parameter", "unknown_parameter")


def _audio_output(cfg: SessionConfig, value: Any) -> None:
    where = "session.audio.output"
    if not isinstance(value, Mapping):
        raise bad(where, "expected an object")
    for key, part in value.items():
        if key == "format":
            cfg.output_format = _format(part, f"{where}.format")
        elif key == "voice":
            if not isinstance(part, str) or not part:
                raise bad(f"{where}.voice", "expected a voice name")
            cfg.voice = part
        elif key == "speed":
            if isinstance(part, bool) or not isinstance(part, int | float):
                raise bad(f"{where}.speed", "expected a number")
            if not 0.25 <= part <= 1.5:
                raise bad(f"{where}.speed", "must be between 0.25 and 1.5")
            cfg.speed = float(part)
        else:
            raise bad(f"{where}.{key}", "unknown parameter", "unknown_parameter")


def _format(value: Any, where: str) -> AudioFormat:
    try:
        return parse_audio_format(value, where)
    except AudioFormatError as exc:
        raise bad(exc.field, str(exc).split(": ", 1)[-1]) from None


def _transcription(value: Any, where: str) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise bad(where, "expected an object or null")
    for key in value:
        if key not in ("model", "language", "prompt"):
            raise bad(f"{where}.{key}", "unknown parameter", "unknown_parameter")
        if value[key] is not None and not isinstance(value[key], str):
            raise bad(f"{where}.{key}", "expected a string")
    return dict(value)


def _turn_detection(value: Any, where: str) -> TurnDetection | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise bad(where, "expected an object or null")
    kind = value.get("type", "server_vad")
    if kind != "server_vad":
        # semantic_vad needs a turn-end model this server does not have.
        raise bad(f"{where}.type", f"only 'server_vad' is supported, got {kind!r}")
    vad_keys = ("threshold", "prefix_padding_ms", "silence_duration_ms")
    flags: dict[str, Any] = {}
    for key, part in value.items():
        if key in ("type", *vad_keys):
            continue
        if key in ("create_response", "interrupt_response"):
            if not isinstance(part, bool):
                raise bad(f"{where}.{key}", "expected a boolean")
            flags[key] = part
        elif key == "idle_timeout_ms":
            # Prompting a silent user is not built; accepting it would silently not act.
            if part is not None:
                raise bad(f"{where}.{key}", "not supported; use null")
        else:
            raise bad(f"{where}.{key}", "unknown parameter", "unknown_parameter")
    try:
        vad = ServerVadParams(**{k: value[k] for k in vad_keys if value.get(k) is not None})
    except BadRequestError as exc:
        raise bad(f"{where}.{exc.param}", str(exc)) from None
    return replace(TurnDetection(vad), **flags)


def _tools(cfg: SessionConfig, value: Any) -> None:
    cfg.tools = check_tools(value, "session.tools")


def _tool_choice(cfg: SessionConfig, value: Any) -> None:
    cfg.tool_choice = check_tool_choice(value, "session.tool_choice")


def _max_output_tokens(cfg: SessionConfig, value: Any) -> None:
    cfg.max_output_tokens = check_max_tokens(value, "session.max_output_tokens")


def _temperature(cfg: SessionConfig, value: Any) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 2
    ):
        raise bad("session.temperature", "expected a number from 0 to 2")
    cfg.temperature = None if value is None else float(value)


def check_tools(value: Any, where: str) -> list[dict[str, Any]]:
    """Realtime's function tools (``{"type": "function", "name", "description",
    "parameters"}``), checked."""
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise bad(where, f"expected a list of at most {MAX_TOOLS} tools")
    for i, tool in enumerate(value):
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise bad(f"{where}[{i}].type", "only function tools are supported")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad(f"{where}[{i}].name", "expected the function's name")
        if not isinstance(tool.get("parameters", {}), Mapping):
            raise bad(f"{where}[{i}].parameters", "expected a JSON schema object")
    return [dict(t) for t in value]


def check_tool_choice(value: Any, where: str) -> str | dict[str, Any]:
    if value in TOOL_CHOICES:
        return value  # type: ignore[no-any-return]
    function = isinstance(value, Mapping) and value.get("type") == "function"
    if function and isinstance(value.get("name"), str):
        return dict(value)
    raise bad(where, 'expected "auto", "none", "required" or {"type": "function", "name"}')


def check_max_tokens(value: Any, where: str) -> int | None:
    if value == "inf" or value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_OUTPUT_TOKENS:
        raise bad(where, f'expected an integer from 1 to {MAX_OUTPUT_TOKENS}, or "inf"')
    return value


_SETTERS = {
    "type": _type,
    "model": _model,
    "instructions": _instructions,
    "output_modalities": _modalities,
    "audio": _audio,
    "tools": _tools,
    "tool_choice": _tool_choice,
    "max_output_tokens": _max_output_tokens,
    "temperature": _temperature,
}
# Accepted and not acted on: what OpenAI's SDKs send by default that has no meaning here.
_IGNORED = frozenset({"object", "id", "expires_at", "include", "tracing", "truncation", "prompt"})
