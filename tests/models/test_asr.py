"""POST /v1/audio/transcriptions on the default voice pipeline over real HTTP, with the
official openai client: the listener (Whisper tiny.en) hears what the talker (Piper)
said, in every response format; the thinker never runs for it, and a typed chat never
runs the listener."""

from __future__ import annotations

import re

import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from omnistage.api.audio_out import OUTPUT_RATE, encode_whole
from tests.integration.harness import HeadProc
from tests.models.test_asr_engine import SENTENCE, word_errors

pytestmark = pytest.mark.slow

PATH = "/v1/audio/transcriptions"
THINKER, LISTENER = 0, 2


@pytest.fixture(scope="module")
def wav(voice_client: openai.OpenAI) -> bytes:
    """SENTENCE said by the pipeline's own voice, as the speech endpoint streams a WAV."""
    speech = voice_client.audio.speech.create(
        model="voice", voice="joe", input=SENTENCE, response_format="wav"
    )
    return speech.content


def _dispatched(head: HeadProc, stage_id: int) -> int:
    return sum(r["dispatched_total"] for r in head.replicas(stage_id))


def _transcribe(client: openai.OpenAI, data: bytes, name: str = "speech.wav", **extra: object):
    return client.audio.transcriptions.create(model="voice", file=(name, data), **extra)  # type: ignore[call-overload]


def test_json_is_the_words_and_never_runs_the_thinker(
    voice_head: HeadProc, voice_client: openai.OpenAI, wav: bytes
) -> None:
    thinker, listener = _dispatched(voice_head, THINKER), _dispatched(voice_head, LISTENER)
    out = _transcribe(voice_client, wav)
    assert word_errors(out.text, SENTENCE) <= 2, out.text
    assert out.text == out.text.strip()
    assert out.usage is not None and out.usage.type == "duration"
    assert out.usage.seconds == pytest.approx(4.5, abs=2.0)
    assert _dispatched(voice_head, THINKER) == thinker
    assert _dispatched(voice_head, LISTENER) == listener + 1


def test_a_typed_chat_never_runs_the_listener(
    voice_head: HeadProc, voice_client: openai.OpenAI
) -> None:
    before = _dispatched(voice_head, LISTENER)
    out = voice_client.chat.completions.create(
        model="voice", messages=[{"role": "user", "content": "Say hi."}], max_tokens=5
    )
    assert out.choices[0].message.content
    assert _dispatched(voice_head, LISTENER) == before


def test_verbose_json_has_segments_language_and_duration(
    voice_client: openai.OpenAI, wav: bytes
) -> None:
    out = _transcribe(voice_client, wav, response_format="verbose_json", temperature=0)
    assert out.language == "english"
    assert out.duration == pytest.approx(4.5, abs=2.0)
    assert out.segments and [s.id for s in out.segments] == list(range(len(out.segments)))
    assert "".join(s.text for s in out.segments).strip() == out.text
    assert all(0 <= s.start <= s.end <= out.duration for s in out.segments)
    assert all(s.tokens and s.avg_logprob < 0 for s in out.segments)
    assert word_errors(out.text, SENTENCE) <= 2, out.text


def test_srt_and_vtt_are_timed_cues(voice_client: openai.OpenAI, wav: bytes) -> None:
    srt = _transcribe(voice_client, wav, response_format="srt")
    cues = [c.split("\n") for c in srt.strip().split("\n\n")]
    assert [c[0] for c in cues] == [str(i) for i in range(1, len(cues) + 1)]
    stamp = r"\d\d:\d\d:\d\d,\d\d\d --> \d\d:\d\d:\d\d,\d\d\d"
    assert all(re.fullmatch(stamp, c[1]) for c in cues), srt
    assert word_errors(" ".join(" ".join(c[2:]) for c in cues), SENTENCE) <= 2, srt
    vtt = _transcribe(voice_client, wav, response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ")
    text = _transcribe(voice_client, wav, response_format="text", language="en")
    assert word_errors(text, SENTENCE) <= 2, text


def test_a_stream_sends_text_deltas_then_the_whole_text(
    voice_client: openai.OpenAI, wav: bytes
) -> None:
    events = list(_transcribe(voice_client, wav, stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    done = [e for e in events if e.type == "transcript.text.done"]
    assert deltas and len(done) == 1 and events[-1] is done[0]
    assert "".join(deltas) == done[0].text
    assert word_errors(done[0].text, SENTENCE) <= 2, done[0].text


@pytest.mark.parametrize("fmt", ["mp3", "flac"])
def test_compressed_uploads_are_heard(voice_client: openai.OpenAI, fmt: str) -> None:
    pcm = voice_client.audio.speech.create(
        model="voice", voice="joe", input=SENTENCE, response_format="pcm"
    ).content
    data = encode_whole(pcm, OUTPUT_RATE, fmt)  # PyAV
    out = _transcribe(voice_client, data, name=f"speech.{fmt}")
    assert word_errors(out.text, SENTENCE) <= 2, out.text


@pytest.mark.parametrize(
    ("data", "fields", "param"),
    [
        (b"garbage, not audio \x00\x01\x02" * 200, {}, "file"),
        (b"", {}, "file"),
        (None, {}, "file"),
        (b"x", {"response_format": "srt", "stream": "true"}, "stream"),
        (b"x", {"timestamp_granularities[]": "word"}, "timestamp_granularities[]"),
        (b"x", {"response_format": "docx"}, "response_format"),
        (b"x", {"temperature": "2"}, "temperature"),
        (b"x", {"stage": "talker"}, "stage"),
    ],
)
def test_bad_forms_are_400s_naming_the_field(
    voice_head: HeadProc, wav: bytes, data: bytes | None, fields: dict[str, str], param: str
) -> None:
    files = {"file": ("a.wav", wav if data == b"x" else data)} if data is not None else None
    r = voice_head.client.post(PATH, data=fields, files=files)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_an_unknown_language_is_a_400(voice_client: openai.OpenAI, wav: bytes) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _transcribe(voice_client, wav, language="fr")  # tiny.en hears English only
    assert info.value.body["param"] == "language"  # type: ignore[index]


def test_uploads_past_the_general_limit_fit_but_not_past_openai_s(voice_head: HeadProc) -> None:
    # The general body limit is 16 MiB; a transcription takes OpenAI's 25 MB file.
    junk = bytes(range(256)) * (17 * 1024 * 1024 // 256)
    r = voice_head.client.post(PATH, files={"file": ("big.wav", junk)}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "file", r.text
    r = voice_head.client.post(PATH, files={"file": ("big.wav", junk * 2)}, timeout=60)
    assert r.status_code == 413, r.text


@pytest.fixture
def voice_schema(voice_head: HeadProc) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{voice_head.url}/openapi.json")


# This route only: the others are fuzzed on the echo pipeline (test_openapi_fuzz.py).
fuzzed = schemathesis.pytest.from_fixture("voice_schema").include(path=PATH)


@fuzzed.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzzed_forms_never_get_a_server_error(case: schemathesis.Case) -> None:
    case.call_and_validate(checks=[not_a_server_error], timeout=60)
