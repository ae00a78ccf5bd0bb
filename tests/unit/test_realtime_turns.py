"""The server-VAD turn detector on synthetic probability sequences: exact timings, no model."""

from __future__ import annotations

import random

import pytest

from omnistage.audio.server_vad import (
    ServerVadParams,
    SpeechStarted,
    SpeechStopped,
    TurnDetector,
    VadEvent,
)
from omnistage.protocol.errors import BadRequestError

W = 32  # ms per window, as the Silero windows


def run(probs: list[float], params: ServerVadParams | None = None) -> list[VadEvent]:
    """Push ``probs`` as consecutive 32 ms windows from 0 ms; every event, in order."""
    detector = TurnDetector(params)
    events = [detector.push(p, i * W, (i + 1) * W) for i, p in enumerate(probs)]
    return [e for e in events if e is not None]


def test_defaults_are_openais() -> None:
    params = ServerVadParams()
    assert (params.threshold, params.prefix_padding_ms, params.silence_duration_ms) == (
        0.5,
        300,
        500,
    )
    assert params.silence_threshold == pytest.approx(0.35)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"threshold": -0.1}, "threshold"),
        ({"threshold": 1.01}, "threshold"),
        ({"threshold": "0.5"}, "threshold"),
        ({"threshold": True}, "threshold"),
        ({"prefix_padding_ms": -1}, "prefix_padding_ms"),
        ({"silence_duration_ms": -5}, "silence_duration_ms"),
        ({"silence_duration_ms": 500.5}, "silence_duration_ms"),
        ({"prefix_padding_ms": True}, "prefix_padding_ms"),
    ],
)
def test_invalid_params_are_a_bad_request_naming_the_field(kwargs: dict, param: str) -> None:
    with pytest.raises(BadRequestError) as caught:
        ServerVadParams(**kwargs)
    assert caught.value.param == param


def test_bounds_are_valid_and_a_tiny_threshold_can_still_end_a_turn() -> None:
    assert ServerVadParams(threshold=0, prefix_padding_ms=0, silence_duration_ms=0)
    assert ServerVadParams(threshold=1).silence_threshold == pytest.approx(0.85)
    assert ServerVadParams(threshold=0.1).silence_threshold == pytest.approx(0.01)
    assert ServerVadParams(threshold=0.005).silence_threshold == pytest.approx(0.005)


def test_a_turn_starts_padded_and_stops_where_its_silence_began() -> None:
    # 20 silent windows (640 ms), 10 of speech (640..960 ms), then silence.
    events = run([0.0] * 20 + [0.9] * 10 + [0.0] * 30)
    assert events == [SpeechStarted(640 - 300), SpeechStopped(960)]


def test_the_stop_fires_once_silence_duration_ms_of_silent_windows_follow() -> None:
    detector = TurnDetector(ServerVadParams(silence_duration_ms=500))
    assert detector.push(0.9, 0, W) == SpeechStarted(0)
    # 500 ms is 15.6 windows: the 16th silent window (ending at 32 + 512 ms) ends the turn.
    for i in range(1, 16):
        assert detector.push(0.0, i * W, (i + 1) * W) is None
        assert detector.speaking
    assert detector.push(0.0, 16 * W, 17 * W) == SpeechStopped(W)
    assert not detector.speaking


def test_prefix_padding_never_reaches_before_the_session_start() -> None:
    assert run([0.0, 0.0, 0.9, 0.0] + [0.0] * 20)[0] == SpeechStarted(0)
    no_pad = ServerVadParams(prefix_padding_ms=0)
    assert run([0.0, 0.0, 0.9] + [0.0] * 20, no_pad)[0] == SpeechStarted(2 * W)


def test_silence_duration_zero_stops_on_the_first_silent_window() -> None:
    params = ServerVadParams(silence_duration_ms=0)
    assert run([0.9, 0.9, 0.1, 0.9, 0.1], params) == [
        SpeechStarted(0),
        SpeechStopped(2 * W),
        SpeechStarted(0),
        SpeechStopped(4 * W),
    ]


def test_probabilities_between_the_thresholds_neither_start_nor_end_a_turn() -> None:
    # 0.4 is below the 0.5 threshold but above the 0.35 silence threshold.
    assert run([0.4] * 100) == []
    events = run([0.9] + [0.4] * 100)
    assert events == [SpeechStarted(0)]


def test_a_dip_inside_speech_only_counts_when_below_the_silence_threshold() -> None:
    params = ServerVadParams(silence_duration_ms=100)  # 4 windows
    # Windows at 0.4 within speech: the turn holds however long they last.
    assert run([0.9, 0.4, 0.4, 0.4, 0.4, 0.4, 0.9], params) == [SpeechStarted(0)]
    # Three silent windows (96 ms) then speech: the countdown restarts from zero.
    assert run([0.9, 0.1, 0.1, 0.1, 0.9, 0.1, 0.1, 0.1], params) == [SpeechStarted(0)]


def test_band_windows_after_silence_began_keep_counting_it() -> None:
    params = ServerVadParams(silence_duration_ms=100)
    # Silence starts at window 1; band windows neither reset nor delay it.
    assert run([0.9, 0.1, 0.4, 0.4, 0.4], params) == [SpeechStarted(0), SpeechStopped(W)]


def test_a_new_turn_can_start_right_after_one_stops() -> None:
    params = ServerVadParams(prefix_padding_ms=50, silence_duration_ms=64)
    events = run([0.9, 0.0, 0.0, 0.9, 0.0, 0.0], params)
    assert events == [
        SpeechStarted(0),
        SpeechStopped(W),
        SpeechStarted(3 * W - 50),
        SpeechStopped(4 * W),
    ]


def test_windows_must_move_forward() -> None:
    detector = TurnDetector()
    detector.push(0.0, 0, W)
    with pytest.raises(ValueError, match="overlaps"):
        detector.push(0.0, 16, 48)
    with pytest.raises(ValueError, match="empty"):
        detector.push(0.0, 64, 64)
    detector.push(0.0, 100, 132)  # a gap (dropped audio) is allowed


def test_reset_forgets_a_turn_under_way() -> None:
    detector = TurnDetector()
    detector.push(0.9, 0, W)
    assert detector.speaking
    detector.reset()
    assert not detector.speaking
    assert detector.push(0.0, 0, W) is None


def test_events_alternate_and_start_before_they_stop_on_random_sequences() -> None:
    rng = random.Random(7)
    for _ in range(200):
        params = ServerVadParams(
            threshold=rng.random(),
            prefix_padding_ms=rng.randrange(0, 500),
            silence_duration_ms=rng.randrange(0, 300),
        )
        probs = [rng.random() for _ in range(rng.randrange(1, 120))]
        events = run(probs, params)
        for i, event in enumerate(events):
            assert isinstance(event, SpeechStarted if i % 2 == 0 else SpeechStopped)
        for start, stop in zip(events[::2], events[1::2], strict=False):
            assert isinstance(start, SpeechStarted) and isinstance(stop, SpeechStopped)
            assert 0 <= start.audio_start_ms < stop.audio_end_ms
