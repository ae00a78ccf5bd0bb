"""A Realtime session's configuration: ``session.update`` patches (all or nothing, each
refusal naming its field) and the GA JSON that ``session.created``/``updated`` echo."""

from __future__ import annotations

from typing import Any

import pytest

from omnistage.audio import smart_turn
from omnistage.audio.formats import PCM, PCMA, PCMU
from omnistage.audio.semantic_vad import SemanticVadParams
from omnistage.audio.server_vad import ServerVadParams
from omnistage.protocol.errors import BadRequestError
from omnistage.realtime.config import SessionConfig, TurnDetection


def refusal(cfg: SessionConfig, patch: Any) -> BadRequestError:
    with pytest.raises(BadRequestError) as info:
        cfg.update(patch)
    return info.value


def test_a_patch_sets_each_field_it_names() -> None:
    cfg = SessionConfig()
    cfg.update(
        {
            "type": "realtime",
            "model": "voice",
            "instructions": "Be terse.",
            "output_modalities": ["text"],
            "audio": {
                "input": {
                    "format": {"type": "audio/pcmu"},
                    "transcription": {"model": "whisper-1", "language": "en"},
                    "turn_detection": {
                        "type": "server_vad",
                        "threshold": 0.7,
                        "silence_duration_ms": 300,
                        "create_response": False,
                    },
                    "noise_reduction": None,
                },
                "output": {"format": "g711_alaw", "voice": "echo", "speed": 1.25},
            },
            "tools": [{"type": "function", "name": "lookup", "parameters": {}}],
            "tool_choice": "required",
            "max_output_tokens": 200,
            "temperature": 0.4,
            # What SDKs send back from session.created: accepted, not acted on.
            "object": "realtime.session",
            "tracing": None,
        }
    )
    assert cfg.model == "voice" and cfg.instructions == "Be terse."
    assert cfg.output_modalities == ("text",)
    assert cfg.input_format == PCMU and cfg.output_format == PCMA
    assert cfg.transcription == {"model": "whisper-1", "language": "en"}
    assert cfg.turn_detection == TurnDetection(
        ServerVadParams(threshold=0.7, silence_duration_ms=300), create_response=False
    )
    assert cfg.voice == "echo" and cfg.speed == 1.25
    assert cfg.tools == [{"type": "function", "name": "lookup", "parameters": {}}]
    assert cfg.tool_choice == "required"
    assert cfg.max_output_tokens == 200 and cfg.temperature == 0.4


def test_semantic_vad_is_taken_and_echoed_with_its_eagerness(monkeypatch) -> None:
    monkeypatch.setattr(smart_turn, "available", lambda: True)
    cfg = SessionConfig()
    td = {"type": "semantic_vad", "eagerness": "low", "interrupt_response": False}
    cfg.update({"audio": {"input": {"turn_detection": td}}})
    assert cfg.turn_detection == TurnDetection(
        SemanticVadParams("low"), create_response=True, interrupt_response=False
    )
    assert cfg.to_json("s", 0)["audio"]["input"]["turn_detection"] == {
        **td,
        "create_response": True,
        "resume_after_backchannel": True,
    }
    cfg.update({"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}})
    assert cfg.turn_detection is not None and cfg.turn_detection.vad == SemanticVadParams()
    # Back to server_vad, whose type may be left out as before.
    cfg.update({"audio": {"input": {"turn_detection": {"threshold": 0.6}}}})
    assert cfg.turn_detection == TurnDetection(ServerVadParams(threshold=0.6))


def test_semantic_vad_without_its_model_is_refused_with_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setattr(smart_turn, "available", lambda: False)
    cfg = SessionConfig()
    err = refusal(cfg, {"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}})
    assert err.param == "session.audio.input.turn_detection.type"
    assert "pip install --no-deps pipecat-ai" in str(err)
    assert cfg.turn_detection == TurnDetection()


def test_null_turn_detection_is_push_to_talk_and_inf_is_no_limit() -> None:
    cfg = SessionConfig(max_output_tokens=10)
    cfg.update({"audio": {"input": {"turn_detection": None}}, "max_output_tokens": "inf"})
    assert cfg.turn_detection is None and cfg.max_output_tokens is None


def test_a_bad_patch_changes_nothing() -> None:
    cfg = SessionConfig()
    before = {name: getattr(cfg, name) for name in cfg.__slots__}
    # Good fields first, the bad one last: none of the good ones may stick.
    err = refusal(
        cfg,
        {
            "instructions": "changed",
            "audio": {"output": {"voice": "echo"}, "input": {"format": {"type": "audio/x"}}},
        },
    )
    assert err.param == "session.audio.input.format.type"
    assert {name: getattr(cfg, name) for name in cfg.__slots__} == before


@pytest.mark.parametrize(
    ("patch", "param", "code"),
    [
        ({"voices": "x"}, "session.voices", "unknown_parameter"),
        ({"type": "beta"}, "session.type", "invalid_value"),
        ({"model": 3}, "session.model", "invalid_value"),
        ({"instructions": None}, "session.instructions", "invalid_value"),
        ({"output_modalities": ["audio", "text"]}, "session.output_modalities", "invalid_value"),
        ({"audio": []}, "session.audio", "invalid_value"),
        ({"audio": {"video": {}}}, "session.audio.video", "unknown_parameter"),
        ({"audio": {"input": {"gain": 1}}}, "session.audio.input.gain", "unknown_parameter"),
        (
            {"audio": {"input": {"noise_reduction": {"type": "near_field"}}}},
            "session.audio.input.noise_reduction",
            "invalid_value",
        ),
        (
            {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}},
            "session.audio.input.format.rate",
            "invalid_value",
        ),
        (
            {"audio": {"output": {"format": {"type": "audio/mp3"}}}},
            "session.audio.output.format.type",
            "invalid_value",
        ),
        ({"audio": {"output": {"voice": ""}}}, "session.audio.output.voice", "invalid_value"),
        ({"audio": {"output": {"speed": 2}}}, "session.audio.output.speed", "invalid_value"),
        ({"audio": {"output": {"speed": True}}}, "session.audio.output.speed", "invalid_value"),
        (
            {"audio": {"output": {"pitch": 1}}},
            "session.audio.output.pitch",
            "unknown_parameter",
        ),
        (
            {"audio": {"input": {"transcription": {"model": "w", "temperature": 0}}}},
            "session.audio.input.transcription.temperature",
            "unknown_parameter",
        ),
        (
            {"audio": {"input": {"transcription": {"language": 1}}}},
            "session.audio.input.transcription.language",
            "invalid_value",
        ),
        (
            {"audio": {"input": {"turn_detection": {"threshold": 1.5}}}},
            "session.audio.input.turn_detection.threshold",
            "invalid_value",
        ),
        (
            {"audio": {"input": {"turn_detection": {"silence_duration_ms": -1}}}},
            "session.audio.input.turn_detection.silence_duration_ms",
            "invalid_value",
        ),
        (
            {"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "x"}}}},
            "session.audio.input.turn_detection.eagerness",
            "invalid_value",
        ),
        (
            {"audio": {"input": {"turn_detection": {"type": "semantic_vad", "threshold": 0.5}}}},
            "session.audio.input.turn_detection.threshold",
            "unknown_parameter",
        ),
        (
            {"audio": {"input": {"turn_detection": {"type": "vad"}}}},
            "session.audio.input.turn_detection.type",
            "invalid_value",
        ),
        (
            {"audio": {"input": {"turn_detection": {"interrupt_response": "yes"}}}},
            "session.audio.input.turn_detection.interrupt_response",
            "invalid_value",
        ),
        (
            {"audio": {"input": {"turn_detection": {"idle_timeout_ms": 5000}}}},
            "session.audio.input.turn_detection.idle_timeout_ms",
            "invalid_value",
        ),
        (
            {"audio": {"input": {"turn_detection": {"eagerness": "low"}}}},
            "session.audio.input.turn_detection.eagerness",
            "unknown_parameter",
        ),
        ({"tools": {}}, "session.tools", "invalid_value"),
        ({"tools": [{"type": "mcp"}]}, "session.tools[0].type", "invalid_value"),
        (
            {"tools": [{"name": "a"}, {"type": "function"}]},
            "session.tools[1].name",
            "invalid_value",
        ),
        (
            {"tools": [{"name": "a", "parameters": "{}"}]},
            "session.tools[0].parameters",
            "invalid_value",
        ),
        ({"tool_choice": "any"}, "session.tool_choice", "invalid_value"),
        ({"tool_choice": {"type": "function"}}, "session.tool_choice", "invalid_value"),
        ({"max_output_tokens": 0}, "session.max_output_tokens", "invalid_value"),
        ({"max_output_tokens": 5000}, "session.max_output_tokens", "invalid_value"),
        ({"max_output_tokens": True}, "session.max_output_tokens", "invalid_value"),
        ({"temperature": 3}, "session.temperature", "invalid_value"),
        ({"temperature": False}, "session.temperature", "invalid_value"),
    ],
)
def test_each_refusal_names_its_field(patch: dict[str, Any], param: str, code: str) -> None:
    err = refusal(SessionConfig(), patch)
    assert (err.param, err.code) == (param, code)
    assert str(err).startswith(param)


def test_a_patch_must_be_an_object() -> None:
    assert refusal(SessionConfig(), ["instructions"]).param == "session"


def test_tool_choice_may_name_a_function() -> None:
    cfg = SessionConfig()
    cfg.update({"tool_choice": {"type": "function", "name": "lookup"}})
    assert cfg.tool_choice == {"type": "function", "name": "lookup"}


def test_the_ga_json_of_a_realtime_session() -> None:
    cfg = SessionConfig(model="voice")
    js = cfg.to_json("sess_1", 1234)
    assert js["type"] == "realtime" and js["object"] == "realtime.session"
    assert js["id"] == "sess_1" and js["expires_at"] == 1234
    assert js["model"] == "voice" and js["output_modalities"] == ["audio"]
    assert js["max_output_tokens"] == "inf" and js["tool_choice"] == "auto"
    audio_in = js["audio"]["input"]
    assert audio_in["format"] == {"type": "audio/pcm", "rate": 24000}
    assert audio_in["transcription"] is None
    assert audio_in["turn_detection"] == {
        "type": "server_vad",
        "threshold": 0.5,
        "prefix_padding_ms": 300,
        "silence_duration_ms": 500,
        "create_response": True,
        "interrupt_response": True,
        "idle_timeout_ms": None,
        "resume_after_backchannel": True,
    }
    assert js["audio"]["output"] == {
        "format": {"type": "audio/pcm", "rate": 24000},
        "voice": "alloy",
        "speed": 1.0,
    }


def test_the_json_follows_updates() -> None:
    cfg = SessionConfig()
    cfg.update(
        {
            "max_output_tokens": 64,
            "audio": {
                "input": {"turn_detection": None, "format": {"type": "audio/pcma"}},
                "output": {"format": {"type": "audio/pcmu"}},
            },
        }
    )
    js = cfg.to_json("s", 0)
    assert js["max_output_tokens"] == 64
    assert js["audio"]["input"]["turn_detection"] is None
    assert js["audio"]["input"]["format"] == {"type": "audio/pcma"}  # no rate for G.711
    assert js["audio"]["output"]["format"] == {"type": "audio/pcmu"}


def test_a_transcription_session_has_only_its_input_audio() -> None:
    cfg = SessionConfig()
    cfg.update({"type": "transcription", "audio": {"input": {"transcription": {"model": "w"}}}})
    js = cfg.to_json("s", 0)
    assert js["type"] == "transcription" and js["object"] == "transcription.session"
    assert set(js) == {"type", "object", "id", "expires_at", "include", "audio"}
    assert set(js["audio"]) == {"input"}
    assert js["audio"]["input"]["transcription"] == {"model": "w"}
    assert js["audio"]["input"]["format"] == PCM.to_json()
