"""What a voice name means to the TTS engine: ids, aliases, "default", and OpenAI's names
(mapped to installed voices by engine_args.openai_voices). No model files are read."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage.config.engine_args import OPENAI_VOICES, TtsArgs
from omnistage.engines.speech.voices import VoiceCatalog, VoiceInfo
from omnistage.protocol.errors import BadRequestError, EngineError


def _voice(voice_id: str) -> VoiceInfo:
    path = Path(f"/nowhere/{voice_id}.onnx")
    return VoiceInfo(voice_id, voice_id.split("-")[1], path, path, 22050, "test")


JOE, AMY = _voice("en_US-joe-medium"), _voice("en_US-amy-low")


def test_every_openai_voice_name_means_the_default_voice_unless_mapped() -> None:
    catalog = VoiceCatalog([AMY, JOE], openai={"nova": "amy", "Onyx": None})
    assert catalog.default == JOE
    assert catalog.resolve("nova") == AMY
    assert catalog.resolve("onyx") == JOE
    for name in OPENAI_VOICES:
        assert catalog.resolve(name.upper()) in (JOE, AMY)
    assert catalog.resolve("alloy") == JOE


def test_an_installed_voice_keeps_its_name_even_if_openai_uses_it() -> None:
    echo = _voice("en_GB-echo-high")
    assert VoiceCatalog([JOE, echo]).resolve("echo") == echo


def test_unknown_names_are_a_bad_request_naming_the_choices() -> None:
    with pytest.raises(BadRequestError) as info:
        VoiceCatalog([JOE]).resolve("zoe")
    assert info.value.param == "voice"
    assert "alloy" in str(info.value) and "joe" in str(info.value)


def test_a_mapping_to_a_voice_not_installed_fails_at_start() -> None:
    with pytest.raises(EngineError, match="openai_voices maps 'nova' to 'kate'"):
        VoiceCatalog([JOE], openai={"nova": "kate"})


def test_the_mapping_is_an_engine_arg() -> None:
    assert TtsArgs.model_validate({"openai_voices": {"alloy": "amy"}}).openai_voices == {
        "alloy": "amy"
    }
