"""WAV headers, PCM durations and sentence splitting for audio engines."""

from __future__ import annotations

import io
import struct
import wave

import pytest

from omnistage.audio.wav import pcm_duration_s, split_sentences, wav_bytes, wav_header


def test_wav_header_with_known_size_has_exact_fields():
    header = wav_header(22050, data_bytes=1000)
    assert len(header) == 44
    riff, riff_size, wave_tag = struct.unpack_from("<4sI4s", header, 0)
    fmt, fmt_size, pcm, channels, rate, byte_rate, align, bits = struct.unpack_from(
        "<4sIHHIIHH", header, 12
    )
    data, data_size = struct.unpack_from("<4sI", header, 36)
    assert (riff, riff_size, wave_tag) == (b"RIFF", 36 + 1000, b"WAVE")
    assert (fmt, fmt_size, pcm, channels, rate) == (b"fmt ", 16, 1, 1, 22050)
    assert (byte_rate, align, bits) == (44100, 2, 16)
    assert (data, data_size) == (b"data", 1000)


def test_wav_header_for_stereo_24_bit():
    header = wav_header(48000, num_channels=2, bits=24, data_bytes=0)
    _, _, _, channels, rate, byte_rate, align, bits = struct.unpack_from("<4sIHHIIHH", header, 12)
    assert (channels, rate, byte_rate, align, bits) == (2, 48000, 48000 * 6, 6, 24)


def test_streaming_wav_header_has_unknown_sizes():
    header = wav_header(16000)
    assert len(header) == 44
    assert struct.unpack_from("<I", header, 4)[0] == 0xFFFFFFFF
    assert struct.unpack_from("<I", header, 40)[0] == 0xFFFFFFFF
    assert header[36:40] == b"data"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sample_rate": 0},
        {"sample_rate": 16000, "num_channels": 0},
        {"sample_rate": 16000, "bits": 12},
        {"sample_rate": 16000, "data_bytes": -1},
    ],
)
def test_wav_header_rejects_bad_formats(kwargs):
    with pytest.raises(ValueError):
        wav_header(**kwargs)


def test_wav_bytes_opens_with_the_wave_module():
    samples = [0, 1000, -1000, 32767, -32768] * 100
    pcm = struct.pack(f"<{len(samples)}h", *samples)
    blob = wav_bytes(pcm, 22050)
    assert len(blob) == 44 + len(pcm)
    with wave.open(io.BytesIO(blob)) as w:
        assert w.getnchannels() == 1
        assert w.getsampwidth() == 2
        assert w.getframerate() == 22050
        assert w.getnframes() == len(samples)
        assert w.readframes(w.getnframes()) == pcm


def test_wav_bytes_of_nothing_is_a_valid_empty_file():
    with wave.open(io.BytesIO(wav_bytes(b"", 8000))) as w:
        assert w.getnframes() == 0


def test_wav_bytes_rejects_odd_byte_counts():
    with pytest.raises(ValueError):
        wav_bytes(b"\x00\x01\x02", 8000)


def test_pcm_duration():
    assert pcm_duration_s(b"\x00" * 44100, 22050) == pytest.approx(1.0)
    assert pcm_duration_s(b"", 22050) == 0.0
    assert pcm_duration_s(b"\x00" * 32000, 16000, num_channels=2) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        pcm_duration_s(b"\x00\x00", 0)


def test_split_returns_complete_sentences_and_the_rest():
    assert split_sentences("Hello there. How are you? I am fine! And") == (
        ["Hello there.", "How are you?", "I am fine!"],
        "And",
    )


def test_terminator_at_the_end_of_the_buffer_is_not_complete_yet():
    assert split_sentences("Pi is 3.") == ([], "Pi is 3.")
    assert split_sentences("Pi is 3.14 exactly. Ne") == (["Pi is 3.14 exactly."], "Ne")
    assert split_sentences("Done!") == ([], "Done!")
    assert split_sentences("Done! ") == (["Done!"], "")


def test_streaming_pieces_give_the_same_sentences_as_the_whole():
    text = "Mr. Smith paid $3.50 today. Really?! Yes, e.g. coffee.\nThen he left. The end."
    whole, rest = split_sentences(text)
    streamed: list[str] = []
    buffer = ""
    for i in range(0, len(text), 3):
        buffer += text[i : i + 3]
        done, buffer = split_sentences(buffer)
        streamed.extend(done)
    assert streamed == whole
    assert buffer == rest == "The end."
    assert whole == [
        "Mr. Smith paid $3.50 today.",
        "Really?!",
        "Yes, e.g. coffee.",
        "Then he left.",
    ]


def test_abbreviations_and_initials_do_not_split():
    sentences, rest = split_sentences("Dr. No met Mrs. Jones vs. J. R. Smith, i.e. nobody. Ok")
    assert sentences == ["Dr. No met Mrs. Jones vs. J. R. Smith, i.e. nobody."]
    assert rest == "Ok"


def test_newlines_end_sentences_and_blank_lines_are_skipped():
    assert split_sentences("first line\n\n   \nsecond line\nthird") == (
        ["first line", "second line"],
        "third",
    )


def test_quotes_and_ellipses():
    assert split_sentences('He said "stop." Then... silence. ') == (
        ['He said "stop."', "Then...", "silence."],
        "",
    )


def test_whitespace_only_buffers():
    assert split_sentences("") == ([], "")
    assert split_sentences("   \n  ") == ([], "")


def test_rest_keeps_trailing_space_so_the_next_word_stays_separate():
    sentences, rest = split_sentences("One. Two ")
    assert sentences == ["One."]
    assert rest + "three." == "Two three."


def test_long_unpunctuated_text_is_cut_after_a_comma_or_space() -> None:
    from omnistage.audio.wav import split_sentences

    text = "word " * 30 + "then, a clause " + "more " * 40
    pieces, rest = split_sentences(text, max_chars=100)
    assert pieces and all(len(p) <= 100 for p in pieces)
    assert " ".join([*pieces, rest]).split() == text.split()
    short, rest2 = split_sentences("no terminator yet", max_chars=100)
    assert short == [] and rest2 == "no terminator yet"


def test_first_clause_is_split_once_long_enough() -> None:
    from omnistage.audio.wav import split_first_clause

    assert split_first_clause("Well, yes") == (None, "Well, yes")  # too short
    clause, rest = split_first_clause("The ocean is vast and deep, teeming with life")
    assert clause == "The ocean is vast and deep,"
    assert rest == "teeming with life"
    assert split_first_clause("no clause end here yet") == (None, "no clause end here yet")
    assert split_first_clause("the value is 3,14 and more") == (None, "the value is 3,14 and more")


def test_split_first_phrase_cuts_before_a_boundary_word_as_soon_as_it_appears() -> None:
    from omnistage.audio.wav import split_first_phrase

    assert split_first_phrase("The capital of France is Paris.") == (
        "The capital of France",
        "is Paris.",
    )
    # The boundary word just written (it may go on to "isn't"): the words before it are
    # complete, so the opening goes now, not a token later.
    assert split_first_phrase("The capital of France is") == ("The capital of France", "is")
    # A word that only starts like one is no boundary.
    assert split_first_phrase("The capital of France i") == (None, "The capital of France i")
    assert split_first_phrase("The capital of France isl") == (None, "The capital of France isl")
    # Fewer than three words before the boundary: keep waiting.
    assert split_first_phrase("Paris is the capital of ") == (None, "Paris is the capital of ")
    # A complete opening clause still comes first.
    clause, rest = split_first_phrase("The ocean is vast and deep, teeming")
    assert (clause, rest) == ("The ocean is vast and deep,", "teeming")
    assert split_first_phrase("The sea and the sky ") == (None, "The sea and the sky ")
