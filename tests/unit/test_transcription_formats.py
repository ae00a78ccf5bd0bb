"""A transcript in each of OpenAI's response formats (api/transcripts.py)."""

from __future__ import annotations

import msgspec
import pytest

from omnistage.api.transcripts import Segment, Transcript, render, srt, timestamp, vtt
from omnistage.protocol.chunk_meta import ChunkMeta, TextMeta


def _segment(i: int, start: float, end: float, text: str) -> Segment:
    return Segment(
        id=i,
        seek=0,
        start=start,
        end=end,
        text=text,
        tokens=[50363, 100 + i, 50400],
        temperature=0.0,
        avg_logprob=-0.25,
        compression_ratio=1.1,
        no_speech_prob=0.01,
    )


SEGMENTS = [
    _segment(0, 0.0, 2.5, " Hello there."),
    _segment(1, 2.5, 3661.0456, " How are you?"),
]
TRANSCRIPT = Transcript(SEGMENTS, "en", 3662.5)


@pytest.mark.parametrize(
    ("seconds", "marker", "expected"),
    [
        (0.0, ",", "00:00:00,000"),
        (2.5, ",", "00:00:02,500"),
        (59.9996, ".", "00:01:00.000"),  # rounds to the millisecond, carrying over
        (3661.0456, ".", "01:01:01.046"),
        (36000.0, ",", "10:00:00,000"),
        (-0.2, ",", "00:00:00,000"),
    ],
)
def test_timestamps_are_hours_minutes_seconds_and_milliseconds(
    seconds: float, marker: str, expected: str
) -> None:
    assert timestamp(seconds, marker) == expected


def test_srt_numbers_cues_from_one_with_comma_milliseconds() -> None:
    assert srt(SEGMENTS) == (
        "1\n00:00:00,000 --> 00:00:02,500\nHello there.\n"
        "\n"
        "2\n00:00:02,500 --> 01:01:01,046\nHow are you?\n"
    )


def test_vtt_has_its_header_and_dot_milliseconds() -> None:
    assert vtt(SEGMENTS) == (
        "WEBVTT\n"
        "\n"
        "00:00:00.000 --> 00:00:02.500\nHello there.\n"
        "\n"
        "00:00:02.500 --> 01:01:01.046\nHow are you?\n"
    )


def test_no_segments_make_empty_subtitles() -> None:
    assert srt([]) == ""
    assert vtt([]) == "WEBVTT\n"
    assert render(Transcript([], "en", 1.0), "json") == {
        "text": "",
        "usage": {"type": "duration", "seconds": 1.0},
    }


def test_text_joins_the_segments_without_whisper_s_leading_space() -> None:
    assert TRANSCRIPT.text == "Hello there. How are you?"
    assert render(TRANSCRIPT, "text") == "Hello there. How are you?\n"


def test_json_is_the_text_and_the_duration_usage() -> None:
    assert render(TRANSCRIPT, "json") == {
        "text": "Hello there. How are you?",
        "usage": {"type": "duration", "seconds": 3662.5},
    }


def test_verbose_json_has_openai_s_shape() -> None:
    body = render(TRANSCRIPT, "verbose_json")
    assert isinstance(body, dict)
    assert body["task"] == "transcribe"
    assert body["language"] == "english"  # Whisper's name, as OpenAI reports it
    assert body["duration"] == 3662.5
    assert body["text"] == "Hello there. How are you?"
    assert [s["id"] for s in body["segments"]] == [0, 1]
    assert set(body["segments"][0]) == {
        "id",
        "seek",
        "start",
        "end",
        "text",
        "tokens",
        "temperature",
        "avg_logprob",
        "compression_ratio",
        "no_speech_prob",
    }
    assert body["segments"][1]["text"] == " How are you?"
    assert body["usage"] == {"type": "duration", "seconds": 3662.5}


def test_verbose_json_parses_as_the_openai_sdk_s_type() -> None:
    from openai.types.audio import TranscriptionVerbose

    parsed = TranscriptionVerbose.model_validate(render(TRANSCRIPT, "verbose_json"))
    assert parsed.segments is not None and parsed.segments[1].end == 3661.0456


def test_an_unknown_language_code_is_reported_as_given() -> None:
    body = render(Transcript(SEGMENTS, "xx", 1.0), "verbose_json")
    assert isinstance(body, dict) and body["language"] == "xx"


def test_a_segment_round_trips_in_a_chunk_s_meta() -> None:
    wire = msgspec.msgpack.encode(TextMeta(segment=SEGMENTS[1]))
    assert msgspec.msgpack.decode(wire, type=ChunkMeta).segment == SEGMENTS[1]


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError):
        render(TRANSCRIPT, "docx")
