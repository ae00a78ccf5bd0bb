"""Realtime audio formats: G.711 against the ITU formulas, resampling that keeps pitch and
level, streams that match one-shot conversion whatever the chunking, and format parsing."""

from __future__ import annotations

import pytest

np = pytest.importorskip("numpy")

from omnistage.audio.formats import (  # noqa: E402
    PCM,
    PCMA,
    PCMU,
    AudioFormatError,
    InputStream,
    OutputStream,
    decode,
    encode,
    from_pcm16,
    parse_audio_format,
    to_pcm16,
)
from omnistage.audio.resample import StreamResampler, resample  # noqa: E402
from omnistage.audio import g711  # noqa: E402

ALL_INT16 = np.arange(-32768, 32768, dtype=np.int16)


def tone(freq: float, rate: int, seconds: float, amplitude: float = 10000.0) -> np.ndarray:
    t = np.arange(round(rate * seconds)) / rate
    return np.rint(amplitude * np.sin(2 * np.pi * freq * t)).astype(np.int16)


def peak_hz(pcm: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(pcm * np.hanning(len(pcm))))
    return float(np.fft.rfftfreq(len(pcm), 1 / rate)[np.argmax(spectrum)])


# G.711 reference: ITU-T G.711's decoding formulas, written out per code, independently
# of the lookup tables (mu-law codes are sent inverted; A-law's even bits are XORed with
# 0x55 and a set sign bit means positive).
def mulaw_reference(code: int) -> int:
    c = ~code & 0xFF
    exponent, mantissa = (c >> 4) & 7, c & 0x0F
    magnitude = ((2 * mantissa + 33) << exponent) - 33  # 14-bit scale
    return 4 * (-magnitude if c & 0x80 else magnitude)


def alaw_reference(code: int) -> int:
    c = code ^ 0x55
    segment, mantissa = (c >> 4) & 7, c & 0x0F
    magnitude = 2 * mantissa + 1 if segment == 0 else (2 * mantissa + 33) << (segment - 1)
    return 8 * (magnitude if c & 0x80 else -magnitude)  # 13-bit scale


def test_g711_silence_codes():
    assert g711.mulaw_encode(np.zeros(1, np.int16)) == b"\xff"
    assert g711.alaw_encode(np.zeros(1, np.int16)) == b"\xd5"


@pytest.mark.parametrize(
    ("decode_table", "reference"),
    [(g711.MULAW_DECODE, mulaw_reference), (g711.ALAW_DECODE, alaw_reference)],
)
def test_g711_decode_tables_match_the_itu_formulas(decode_table, reference):
    assert decode_table.tolist() == [reference(code) for code in range(256)]


@pytest.mark.parametrize(
    ("enc", "dec", "largest"),
    [(g711.mulaw_encode, g711.mulaw_decode, 32124), (g711.alaw_encode, g711.alaw_decode, 32256)],
)
def test_g711_round_trip_of_every_int16_within_half_a_step(enc, dec, largest):
    out = dec(enc(ALL_INT16)).astype(np.int64)
    x = ALL_INT16.astype(np.int64)
    # Each decoded value is the middle of its step: find the step from the code's neighbours.
    levels = np.unique(dec(bytes(range(256))).astype(np.int64))
    steps = np.diff(levels)
    idx = np.clip(np.searchsorted(levels, out), 1, len(levels) - 1)
    half_step = np.maximum(steps[idx - 1], steps[np.minimum(idx, len(steps) - 1)]) / 2
    inside = np.abs(x) <= largest
    assert np.all(np.abs(out - x)[inside] <= half_step[inside])
    assert np.all(out[~inside] == np.sign(x[~inside]) * largest)  # clipped beyond the last code
    assert np.all(np.diff(out) >= 0)  # monotonic


def test_g711_decode_then_encode_is_identity():
    codes = bytes(range(256))
    assert g711.alaw_encode(g711.alaw_decode(codes)) == codes
    # mu-law has a negative zero (0x7F) that decodes to 0, which encodes as 0xFF.
    expected = codes.replace(b"\x7f", b"\xff")
    assert g711.mulaw_encode(g711.mulaw_decode(codes)) == expected


def test_g711_refuses_non_int16():
    with pytest.raises(TypeError):
        g711.mulaw_encode(np.zeros(4, np.int32))


def test_1khz_through_24k_8k_24k_keeps_pitch_and_level():
    x = tone(1000, 24000, 1.0)
    down = resample(x, 24000, 8000)
    back = resample(down, 8000, 24000)
    assert (len(down), len(back)) == (8000, 24000)
    for pcm, rate in ((down, 8000), (back, 24000)):
        assert abs(peak_hz(pcm, rate) - 1000) <= 2
        rms = np.sqrt(np.mean(pcm[200:-200].astype(np.float64) ** 2))
        assert rms == pytest.approx(10000 / np.sqrt(2), rel=0.03)
    assert np.max(np.abs(back[100:-100].astype(np.int64) - x[100:-100])) < 100  # aligned


def test_downsampling_filters_out_what_the_lower_rate_cannot_hold():
    x = tone(6000, 24000, 0.5)  # above 8 kHz's Nyquist: would alias to 2 kHz unfiltered
    y = resample(x, 24000, 8000)
    assert np.sqrt(np.mean(y[100:-100].astype(np.float64) ** 2)) < 0.01 * 10000


@pytest.mark.parametrize(
    ("src", "dst"), [(24000, 8000), (8000, 24000), (22050, 24000), (24000, 16000)]
)
def test_stream_equals_one_shot_for_every_chunk_size(src, dst):
    x = tone(440, src, 0.06) + tone(3100, src, 0.06, 3000)
    expected = resample(x, src, dst)
    assert len(expected) == -(-len(x) * dst // src)
    stream = StreamResampler(src, dst)
    for chunk in range(1, 961):
        parts = [stream.push(x[i : i + chunk]) for i in range(0, len(x), chunk)]
        got = np.concatenate([*parts, stream.flush()])  # flush also resets the stream
        assert len(got) == len(expected), chunk
        assert np.max(np.abs(got.astype(np.int64) - expected)) <= 1, chunk


def test_stream_resampler_same_rate_passes_through():
    x = tone(440, 24000, 0.01)
    stream = StreamResampler(24000, 24000)
    assert np.array_equal(np.concatenate([stream.push(x[:7]), stream.push(x[7:])]), x)
    assert len(stream.flush()) == 0


def test_piper_rate_to_every_output_format():
    x = tone(440, 22050, 0.5)
    pcm_bytes = from_pcm16(PCM, x, 22050)
    assert len(pcm_bytes) == 2 * 12000
    for fmt in (PCMU, PCMA):
        data = from_pcm16(fmt, x, 22050)
        assert len(data) == 4000
        assert abs(peak_hz(decode(fmt, data), 8000) - 440) <= 4
    assert abs(peak_hz(decode(PCM, pcm_bytes), 24000) - 440) <= 4


def test_to_pcm16_for_vad_rate_from_every_input_format():
    x = tone(700, 24000, 0.5)
    for fmt in (PCM, PCMU, PCMA):
        data = encode(fmt, x, 24000)
        pcm = to_pcm16(fmt, data, 16000)
        assert len(pcm) == 8000
        assert abs(peak_hz(pcm, 16000) - 700) <= 4


def test_pcm_is_little_endian():
    assert encode(PCM, np.array([1, -2], np.int16)) == b"\x01\x00\xfe\xff"
    assert decode(PCM, b"\x01\x00\xfe\xff").tolist() == [1, -2]


def test_one_shot_refuses_odd_length_pcm():
    with pytest.raises(AudioFormatError, match="2-byte samples"):
        decode(PCM, b"\x00\x00\x00")


def test_input_stream_carries_a_split_sample():
    x = tone(440, 24000, 0.1)
    data = encode(PCM, x)
    stream = InputStream(PCM, 24000)
    parts = []
    for i in range(0, len(data), 7):  # odd chunks split samples
        parts.append(stream.push(data[i : i + 7]))
        assert stream.pending_bytes == (min(i + 7, len(data))) % 2
    parts.append(stream.flush())
    assert np.array_equal(np.concatenate(parts), x)
    # A half sample left at the end cannot be decoded: the stream's end drops it.
    assert len(stream.push(b"\x01")) == 0 and stream.pending_bytes == 1
    assert len(stream.flush()) == 0 and stream.pending_bytes == 0


@pytest.mark.parametrize("fmt", [PCM, PCMU, PCMA])
def test_streams_match_one_shot_in_20ms_chunks(fmt):
    x = tone(440, 24000, 0.5)
    data = encode(fmt, x)
    inp = InputStream(fmt, 16000)
    n = len(data) // 25  # 20 ms
    got = np.concatenate(
        [*(inp.push(data[i : i + n]) for i in range(0, len(data), n)), inp.flush()]
    )
    assert np.max(np.abs(got.astype(np.int64) - to_pcm16(fmt, data, 16000))) <= 1
    speech = tone(440, 22050, 0.5)
    out = OutputStream(fmt, 22050)
    chunks = [out.push(speech[i : i + 441]) for i in range(0, len(speech), 441)]
    assert b"".join([*chunks, out.flush()]) == from_pcm16(fmt, speech, 22050)


def test_parse_formats():
    assert parse_audio_format({"type": "audio/pcm", "rate": 24000}) is PCM
    assert parse_audio_format({"type": "audio/pcm"}) is PCM
    assert parse_audio_format({"type": "audio/pcmu"}) is PCMU
    assert parse_audio_format({"type": "audio/pcma"}) is PCMA
    assert parse_audio_format("g711_ulaw") is PCMU  # the beta API's names
    assert (PCMU.rate, PCMU.bytes_per_sample, PCM.bytes_per_sample) == (8000, 1, 2)
    assert PCM.to_json() == {"type": "audio/pcm", "rate": 24000}
    assert PCMA.to_json() == {"type": "audio/pcma"}


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"type": "audio/pcm", "rate": 16000}, "audio.output.format.rate"),
        ({"type": "audio/pcm", "rate": "24000"}, "audio.output.format.rate"),
        ({"type": "audio/pcm", "rate": True}, "audio.output.format.rate"),
        ({"type": "audio/pcmu", "rate": 24000}, "audio.output.format.rate"),
        ({"type": "audio/opus"}, "audio.output.format.type"),
        ({"rate": 24000}, "audio.output.format.type"),
        ({"type": "audio/pcm", "channels": 2}, "audio.output.format.channels"),
        ("wav", "audio.output.format"),
        (None, "audio.output.format"),
    ],
)
def test_parse_errors_name_the_field(value, field):
    with pytest.raises(AudioFormatError) as err:
        parse_audio_format(value, "audio.output.format")
    assert err.value.field == field
    assert str(err.value).startswith(field + ":")
    assert isinstance(err.value, ValueError)
