"""The semantic turn detector's state machine, with a scripted end-of-turn model and synthetic
window probabilities (the audio's clock: 32 ms windows)."""

from __future__ import annotations

import pytest

from omnistage.audio.semantic_vad import (
    CHECK_MS,
    SemanticTurnDetector,
    SemanticVadParams,
    SpeechStarted,
    SpeechStopped,
)
from omnistage.protocol.errors import BadRequestError

W = 32  # ms per window


class Model:
    """Answers each question with the next scripted probability; records what it was asked."""

    def __init__(self, *verdicts: float) -> None:
        self.verdicts = list(verdicts)
        self.asked: list[tuple[int, int]] = []

    def __call__(self, start_ms: int, end_ms: int) -> float:
        self.asked.append((start_ms, end_ms))
        return self.verdicts.pop(0)


def run(detector: SemanticTurnDetector, probs: list[float], at: int = 0) -> list[tuple]:
    """Push ``probs`` as consecutive windows from ``at`` ms; (window start, event) pairs."""
    out = []
    for i, p in enumerate(probs):
        start = at + i * W
        event = detector.push(p, start, start + W)
        if event is not None:
            out.append((start, event))
    return out


def speech(ms: int) -> list[float]:
    return [0.9] * (ms // W)


def quiet(ms: int) -> list[float]:
    return [0.05] * (ms // W)


def test_a_finished_turn_ends_where_its_silence_began_once_the_model_agrees() -> None:
    model = Model(0.99)
    d = SemanticTurnDetector(SemanticVadParams(), model)
    events = run(d, quiet(320) + speech(640) + quiet(640))
    assert events[0] == (320, SpeechStarted(20))  # 300 ms of prefix padding
    start, stopped = events[1]
    assert stopped == SpeechStopped(960)
    # Asked once, as soon as the silence had lasted CHECK_MS, about the turn's audio so far.
    assert model.asked == [(20, start + W)] and start + W - 960 >= CHECK_MS
    assert start + W - 960 < CHECK_MS + W
    assert not d.speaking


def test_a_pause_the_model_calls_unfinished_does_not_end_the_turn() -> None:
    model = Model(0.1, 0.99)
    d = SemanticTurnDetector(SemanticVadParams(), model)
    # "I'd like to ... [700 ms] ... book a table."
    events = run(d, speech(640) + quiet(704) + speech(640) + quiet(320))
    assert [type(e) for _, e in events] == [SpeechStarted, SpeechStopped]
    assert events[1][1] == SpeechStopped(640 + 704 + 640)
    assert len(model.asked) == 2  # once per pause, never again in the same silence


def test_a_turn_the_model_calls_likely_finished_ends_after_a_longer_silence() -> None:
    for eagerness, wait in (("low", 2000), ("medium", 1000), ("high", 500)):
        model = Model(0.7)
        d = SemanticTurnDetector(SemanticVadParams(eagerness), model)  # type: ignore[arg-type]
        # A 700 ms pause survives "low" and "medium"; "high" is eager enough to end there.
        paused = run(d, speech(320) + quiet(704) + speech(320))
        assert len(paused) == (3 if eagerness == "high" else 1), eagerness
        d = SemanticTurnDetector(SemanticVadParams(eagerness), Model(0.7))  # type: ignore[arg-type]
        start, stopped = run(d, speech(320) + quiet(wait + 320))[1]
        assert stopped == SpeechStopped(320)
        assert start + W - 320 == pytest.approx(wait, abs=W), eagerness


def test_an_unfinished_sounding_turn_ends_after_the_eagernesss_longest_wait() -> None:
    for eagerness, wait in (("low", 8000), ("medium", 4000), ("auto", 4000), ("high", 2000)):
        model = Model(0.0)
        d = SemanticTurnDetector(SemanticVadParams(eagerness), model)  # type: ignore[arg-type]
        events = run(d, speech(320) + quiet(wait + 320))
        start, stopped = events[1]
        assert stopped == SpeechStopped(320)
        assert start + W - 320 == pytest.approx(wait, abs=W), eagerness
        assert len(model.asked) == 1


def test_eagerness_moves_the_threshold() -> None:
    verdict = 0.98  # finished to "high" and "medium", not sure enough for "low"
    ended = {}
    for eagerness in ("low", "medium", "high"):
        d = SemanticTurnDetector(SemanticVadParams(eagerness), Model(verdict))  # type: ignore[arg-type]
        ended[eagerness] = len(run(d, speech(320) + quiet(320))) == 2
    assert ended == {"low": False, "medium": True, "high": True}
    assert (
        SemanticVadParams("low").threshold
        > SemanticVadParams("medium").threshold
        > SemanticVadParams("high").threshold
    )
    assert SemanticVadParams("auto").threshold == SemanticVadParams("medium").threshold


def test_speech_dips_inside_the_hysteresis_band_neither_start_a_silence_nor_a_verdict() -> None:
    model = Model()
    d = SemanticTurnDetector(SemanticVadParams(), model)
    run(d, speech(320) + [0.4] * 20 + speech(96))  # 640 ms between 0.35 and 0.5
    assert d.speaking and d.silence_from is None and model.asked == []


def test_reset_forgets_the_turn_and_a_bad_eagerness_is_refused() -> None:
    d = SemanticTurnDetector(SemanticVadParams(), Model())
    run(d, speech(320) + quiet(96))
    assert d.speaking and d.silence_from == 320
    d.reset()
    assert not d.speaking and d.silence_from is None
    assert run(d, speech(64))[0][1] == SpeechStarted(0)
    with pytest.raises(ValueError, match="overlaps"):
        d.push(0.9, 0, W)
    with pytest.raises(BadRequestError) as info:
        SemanticVadParams("eager")  # type: ignore[arg-type]
    assert info.value.param == "eagerness"
