"""What one response is asked for (``ResponseSettings``): ``response.create``'s
``response`` object decoded (``options.ResponseParams``) and laid over the session's
settings (each field it gives replaces the session's for this response only), and the
stage parameters that asks of the thinker and talker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from msgspec import UNSET

from omnistage.audio.formats import AudioFormat
from omnistage.protocol.params import GenerationParams, SpeechParams, StageParams
from omnistage.realtime.config import SessionConfig, audio_format
from omnistage.realtime.options import (
    ResponseAudioOutput,
    ResponseParams,
    bad,
    decode,
    max_tokens_value,
    tool_choice_value,
    tool_dicts,
)


@dataclass
class ResponseSettings:
    """What one response is asked for: the session's settings over ``response.create``'s."""

    modalities: tuple[str, ...]
    output_format: AudioFormat
    voice: str
    speed: float
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    max_output_tokens: int | None
    temperature: float | None
    in_conversation: bool = True
    metadata: dict[str, Any] | None = None

    def params(
        self, thinker: int, talker: int | None, speakers: tuple[int, ...] = ()
    ) -> dict[int, StageParams]:
        """Each stage's params: the thinker's generation, and the voice for the talker
        and the ``speakers`` before it (an omni talker speaks in its code-to-wave
        stage's voice)."""
        # The session's ``truncation: "auto"``: a conversation longer than the thinker's
        # window loses its oldest exchanges, not the answer.
        gen: dict[str, Any] = {"truncation": "auto"}
        if self.max_output_tokens is not None:
            gen["max_tokens"] = self.max_output_tokens
        if self.temperature is not None:
            gen["temperature"] = self.temperature
        if self.tools and self.tool_choice != "none":
            gen["tools"] = [_chat_tool(t) for t in self.tools]
            gen["tool_choice"] = _chat_tool_choice(self.tool_choice)
        out = {thinker: StageParams(text=GenerationParams(**gen))}
        if talker is not None:
            for sid in {talker, *speakers}:
                out[sid] = StageParams(speech=SpeechParams(self.voice, self.speed))
        return out


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice["name"]}}


def reply_settings(config: SessionConfig, params: Any) -> ResponseSettings:
    given = decode(params, ResponseParams, "response")
    settings = ResponseSettings(
        modalities=config.output_modalities,
        output_format=config.output_format,
        voice=config.voice,
        speed=config.speed,
        tools=config.tools,
        tool_choice=config.tool_choice,
        max_output_tokens=config.max_output_tokens,
        temperature=config.temperature,
        in_conversation=given.conversation == "auto",
        metadata=given.metadata or None,
    )
    if given.output_modalities is not UNSET:
        settings.modalities = tuple(given.output_modalities)
    if given.tools is not UNSET:
        settings.tools = tool_dicts(given.tools)
    if given.tool_choice is not UNSET:
        settings.tool_choice = tool_choice_value(given.tool_choice)
    if given.max_output_tokens is not UNSET:
        settings.max_output_tokens = max_tokens_value(given.max_output_tokens)
    if given.temperature is not UNSET and given.temperature is not None:
        settings.temperature = given.temperature
    if given.audio is not None:
        _audio(settings, given.audio)
    return settings


def _audio(settings: ResponseSettings, audio: dict[str, Any]) -> None:
    # An answer's audio has only its output side: anything else names ``audio`` itself.
    output = audio.get("output")
    if not isinstance(output, dict) or set(audio) - {"output"}:
        raise bad("response.audio", 'expected {"output": {"format", "voice"}}')
    given = decode(output, ResponseAudioOutput, "response.audio.output")
    if given.format is not UNSET:
        settings.output_format = audio_format(given.format, "response.audio.output.format")
    if given.voice is not UNSET:
        settings.voice = given.voice
