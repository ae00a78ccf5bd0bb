"""The typed params between API and engines (protocol/params.py): decoding untyped
params as one engine kind reads them, layering them per stage, and the wire."""

from __future__ import annotations

import msgspec
import pytest

from omnistage.config.load import load_config
from omnistage.dataplane.graph import StageGraph
from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import Prompt
from omnistage.protocol.params import (
    NO_PARAMS,
    GenerationParams,
    ParamKind,
    SpeechParams,
    StageParams,
    decode,
    kind_of,
)


def test_decoding_keeps_the_kind_s_fields_and_ignores_the_rest() -> None:
    params = decode(ParamKind.TEXT, {"temperature": 0.5, "voice": "joe", "num_chunks": 2})
    assert params == StageParams(text=GenerationParams(temperature=0.5))
    assert decode(ParamKind.SPEECH, {"temperature": 0.5, "voice": "joe"}) == StageParams(
        speech=SpeechParams(voice="joe")
    )


def test_nothing_a_kind_reads_decodes_to_no_params() -> None:
    assert decode(ParamKind.TEXT, {}) is NO_PARAMS
    assert decode(ParamKind.IMAGE, {"temperature": 1.0}).empty


@pytest.mark.parametrize(
    ("kind", "raw", "param"),
    [
        (ParamKind.TEXT, {"temperature": 2.5}, "temperature"),
        (ParamKind.TEXT, {"max_tokens": 0}, "max_tokens"),
        (ParamKind.TEXT, {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (ParamKind.TEXT, {"logit_bias": {"x": 1}}, "logit_bias"),
        (ParamKind.SPEECH, {"speed": 9}, "speed"),
        (ParamKind.TRANSCRIPTION, {"temperature": "warm"}, "temperature"),
        (ParamKind.IMAGE, {"n": 11}, "n"),
        (ParamKind.IMAGE, {"output_format": "gif"}, "output_format"),
    ],
)
def test_a_bad_value_is_a_bad_request_naming_the_field(
    kind: ParamKind, raw: dict, param: str
) -> None:
    with pytest.raises(BadRequestError) as info:
        decode(kind, raw)
    assert info.value.param == param


def test_a_later_layer_wins_field_by_field() -> None:
    defaults = StageParams(text=GenerationParams(temperature=0.7, top_p=0.9, max_tokens=256))
    request = StageParams(text=GenerationParams(temperature=0.0), speech=SpeechParams("joe"))
    merged = defaults.merged(request).merged(StageParams(text=GenerationParams(max_tokens=8)))
    assert merged.generation == GenerationParams(temperature=0.0, top_p=0.9, max_tokens=8)
    assert merged.speaking == SpeechParams("joe")
    assert defaults.merged(None) is defaults and NO_PARAMS.merged(request) is request


def test_each_stage_gets_its_defaults_under_the_request_under_its_own() -> None:
    graph = StageGraph(load_config("voice"))
    thinker, talker = 0, 1
    request = PipelineRequest(
        "r",
        Prompt(text="hi"),
        [thinker, talker],
        StageParams(text=GenerationParams(temperature=0.2)),
        {talker: StageParams(speech=SpeechParams(voice="joe"))},
    )
    # voice.yaml's thinker defaults: temperature 0.7, top_p 0.9, max_tokens 256.
    assert graph.params_for(thinker, request).generation == GenerationParams(
        max_tokens=256, temperature=0.2, top_p=0.9
    )
    talking = graph.params_for(talker, request)
    assert talking.speaking.voice == "joe" and talking.generation.temperature == 0.2


def test_every_engine_reads_one_kind() -> None:
    assert kind_of("llm") == kind_of("vllm") == kind_of("echo") == ParamKind.TEXT
    assert (kind_of("tts"), kind_of("asr"), kind_of("diffusion")) == (
        ParamKind.SPEECH,
        ParamKind.TRANSCRIPTION,
        ParamKind.IMAGE,
    )


def test_unset_fields_stay_off_the_wire() -> None:
    params = StageParams(text=GenerationParams(temperature=0.5))
    wire = msgspec.msgpack.encode(params)
    assert msgspec.msgpack.decode(wire) == {"text": {"temperature": 0.5}}
    assert msgspec.msgpack.decode(wire, type=StageParams) == params
