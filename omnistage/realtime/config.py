"""A Realtime session's configuration: what ``session.update`` sets and
``session.created``/``session.updated`` echo, in OpenAI's GA shape.

``SessionConfig.update`` decodes a whole patch (``options.SessionPatch``) before it
changes anything, so a bad update leaves the session as it was; every error names the
field it refuses (``session.audio.input.turn_detection.threshold``), as OpenAI's
``error.param`` does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from msgspec import UNSET, to_builtins

from omnistage.audio import smart_turn
from omnistage.audio.formats import PCM, AudioFormat, AudioFormatError, parse_audio_format
from omnistage.audio.semantic_vad import SemanticVadParams
from omnistage.audio.server_vad import ServerVadParams
from omnistage.protocol.enums import Modality
from omnistage.realtime.options import (
    InputAudio,
    OutputAudio,
    SemanticVad,
    ServerVad,
    SessionKind,
    SessionPatch,
    bad,
    decode,
    max_tokens_value,
    tool_choice_value,
    tool_dicts,
    turn_detection_options,
)

# Empty: the thinker stage's own ``system_prompt`` applies (the default pipeline's is
# the one bench/bench_answers.py measured best); a session's ``instructions`` replace it.
DEFAULT_INSTRUCTIONS = ""


@dataclass(frozen=True, slots=True)
class TurnDetection:
    """``turn_detection: {"type": "server_vad" | "semantic_vad", ...}``; None on the
    session is push-to-talk."""

    vad: ServerVadParams | SemanticVadParams = field(default_factory=ServerVadParams)
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None
    # Ours, not OpenAI's: speech over an answer that turns out to be a backchannel
    # resumes it (``interruptions``); False cancels it at once.
    resume_after_backchannel: bool = True

    def to_json(self) -> dict[str, Any]:
        if isinstance(self.vad, SemanticVadParams):
            return {
                "type": "semantic_vad",
                "eagerness": self.vad.eagerness,
                "create_response": self.create_response,
                "interrupt_response": self.interrupt_response,
                "resume_after_backchannel": self.resume_after_backchannel,
            }
        return {
            "type": "server_vad",
            "threshold": self.vad.threshold,
            "prefix_padding_ms": self.vad.prefix_padding_ms,
            "silence_duration_ms": self.vad.silence_duration_ms,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
            "idle_timeout_ms": self.idle_timeout_ms,
            "resume_after_backchannel": self.resume_after_backchannel,
        }


@dataclass(slots=True)
class SessionConfig:
    kind: SessionKind = SessionKind.REALTIME
    model: str = ""
    instructions: str = DEFAULT_INSTRUCTIONS
    output_modalities: tuple[str, ...] = (Modality.AUDIO,)
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
        given = decode(patch, SessionPatch, "session")
        new = copy.copy(self)
        new._apply(given)
        for name in self.__slots__:  # type: ignore[attr-defined]
            setattr(self, name, getattr(new, name))

    def _apply(self, p: SessionPatch) -> None:
        if p.type is not UNSET:
            self.kind = p.type
        if p.model is not UNSET:
            self.model = p.model
        if p.instructions is not UNSET:
            self.instructions = p.instructions
        if p.output_modalities is not UNSET:
            self.output_modalities = tuple(p.output_modalities)
        if p.audio is not UNSET:
            if p.audio.input is not UNSET:
                self._apply_input(p.audio.input)
            if p.audio.output is not UNSET:
                self._apply_output(p.audio.output)
        if p.tools is not UNSET:
            self.tools = tool_dicts(p.tools)
        if p.tool_choice is not UNSET:
            self.tool_choice = tool_choice_value(p.tool_choice)
        if p.max_output_tokens is not UNSET:
            self.max_output_tokens = max_tokens_value(p.max_output_tokens)
        if p.temperature is not UNSET:
            self.temperature = p.temperature

    def _apply_input(self, p: InputAudio) -> None:
        where = "session.audio.input"
        if p.format is not UNSET:
            self.input_format = audio_format(p.format, f"{where}.format")
        if p.transcription is not UNSET:
            self.transcription = to_builtins(p.transcription)
        if p.turn_detection is not UNSET:
            where = f"{where}.turn_detection"
            given = p.turn_detection
            options = None if given is None else turn_detection_options(given, where)
            self.turn_detection = turn_detection(options, where)

    def _apply_output(self, p: OutputAudio) -> None:
        if p.format is not UNSET:
            self.output_format = audio_format(p.format, "session.audio.output.format")
        if p.voice is not UNSET:
            self.voice = p.voice
        if p.speed is not UNSET:
            self.speed = p.speed

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
        if self.kind == SessionKind.TRANSCRIPTION:
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


def audio_format(value: Any, where: str) -> AudioFormat:
    try:
        return parse_audio_format(value, where)
    except AudioFormatError as exc:
        raise bad(exc.field, str(exc).split(": ", 1)[-1]) from None


def turn_detection(given: ServerVad | SemanticVad | None, where: str) -> TurnDetection | None:
    if given is None:
        return None
    if isinstance(given, SemanticVad):
        if not smart_turn.available():
            raise bad(
                f"{where}.type",
                f"semantic_vad needs the Smart Turn v3 model, not installed here "
                f"({smart_turn.INSTALL})",
            )
        semantic = SemanticVadParams(given.eagerness)
        return TurnDetection(
            semantic,
            given.create_response,
            given.interrupt_response,
            resume_after_backchannel=given.resume_after_backchannel,
        )
    vad_keys = ("threshold", "prefix_padding_ms", "silence_duration_ms")
    vad = ServerVadParams(
        **{k: getattr(given, k) for k in vad_keys if getattr(given, k) is not None}
    )
    return TurnDetection(
        vad,
        given.create_response,
        given.interrupt_response,
        resume_after_backchannel=given.resume_after_backchannel,
    )
