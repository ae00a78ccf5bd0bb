"""What one response is asked for: ``response.create``'s ``response`` object checked and
laid over the session's settings (each field it gives replaces the session's for this
response only)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omnistage.audio.formats import AudioFormatError, parse_audio_format
from omnistage.realtime.config import (
    MODALITIES,
    SessionConfig,
    bad,
    check_max_tokens,
    check_tool_choice,
    check_tools,
)
from omnistage.realtime.response_run import ResponseSettings

# Read by the session itself (which items the answer hears, and its instructions).
_SESSION_KEYS = frozenset({"input", "instructions"})
_KEYS = frozenset(
    {
        "conversation",
        "output_modalities",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "metadata",
        "audio",
        "temperature",
        "prompt",
    }
)


def reply_settings(config: SessionConfig, params: Any) -> ResponseSettings:
    if not isinstance(params, Mapping):
        raise bad("response", "expected an object")
    for key in params:
        if key not in _KEYS and key not in _SESSION_KEYS:
            raise bad(f"response.{key}", "unknown parameter", "unknown_parameter")
    settings = ResponseSettings(
        modalities=config.output_modalities,
        output_format=config.output_format,
        voice=config.voice,
        speed=config.speed,
        tools=config.tools,
        tool_choice=config.tool_choice,
        max_output_tokens=config.max_output_tokens,
        temperature=config.temperature,
    )
    conversation = params.get("conversation", "auto")
    if conversation not in ("auto", "none"):
        raise bad("response.conversation", 'expected "auto" or "none"')
    settings.in_conversation = conversation == "auto"
    if "output_modalities" in params:
        value = params["output_modalities"]
        if not isinstance(value, list) or len(value) != 1 or value[0] not in MODALITIES:
            raise bad("response.output_modalities", 'expected ["audio"] or ["text"]')
        settings.modalities = tuple(value)
    if "tools" in params:
        settings.tools = check_tools(params["tools"], "response.tools")
    if "tool_choice" in params:
        settings.tool_choice = check_tool_choice(params["tool_choice"], "response.tool_choice")
    if "max_output_tokens" in params:
        value = params["max_output_tokens"]
        settings.max_output_tokens = check_max_tokens(value, "response.max_output_tokens")
    if "temperature" in params and params["temperature"] is not None:
        value = params["temperature"]
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 2:
            raise bad("response.temperature", "expected a number from 0 to 2")
        settings.temperature = float(value)
    metadata = params.get("metadata")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise bad("response.metadata", "expected an object")
    settings.metadata = dict(metadata) if metadata else None
    if "instructions" in params and not isinstance(params["instructions"], str):
        raise bad("response.instructions", "expected a string")
    _audio(settings, params.get("audio"))
    return settings


def _audio(settings: ResponseSettings, audio: Any) -> None:
    if audio is None:
        return
    output = audio.get("output") if isinstance(audio, Mapping) else None
    if not isinstance(output, Mapping) or set(audio) - {"output"}:
        raise bad("response.audio", 'expected {"output": {"format", "voice"}}')
    for key, value in output.items():
        if key == "format":
            try:
                settings.output_format = parse_audio_format(value, "response.audio.output.format")
            except AudioFormatError as exc:
                raise bad(exc.field, str(exc).split(": ", 1)[-1]) from None
        elif key == "voice":
            if not isinstance(value, str) or not value:
                raise bad("response.audio.output.voice", "expected a voice name")
            settings.voice = value
        else:
            raise bad(f"response.audio.output.{key}", "unknown parameter", "unknown_parameter")
