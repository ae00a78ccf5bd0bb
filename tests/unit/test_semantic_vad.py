"""The semantic turn detector's state machine, with a scripted end-of-turn model and synthetic
window probabilities (the audio's clock: 32 ms windows)."""

from __future__ import annotations

import pytest

from omnistage.audio.semantic_vad import (
    CHECK_MS,
    EAGERNESS,
    FIRST_CHECK_MS,
    LEAD_MS,
    WORDS_END,
    WORDS_END_EAGER,
    WORDS_END_LATE,
    WORDS_LATE_MS,
    Question,
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

    def __call__(self, question: Question) -> float:
        self.asked.append((question.start_ms, question.end_ms))
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
    # Asked once, LEAD_MS before the silence had lasted CHECK_MS, about the turn's audio up
    # to CHECK_MS into it; the turn ended once the silence lasted that long.
    assert model.asked == [(20, 960 + CHECK_MS)]
    assert start + W - 960 == CHECK_MS
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
        model = Model(0.7, 0.7)  # "high" asks twice
        d = SemanticTurnDetector(SemanticVadParams(eagerness), model)  # type: ignore[arg-type]
        # A 700 ms pause survives "low" and "medium"; "high" is eager enough to end there.
        paused = run(d, speech(320) + quiet(704) + speech(320))
        assert len(paused) == (3 if eagerness == "high" else 1), eagerness
        d = SemanticTurnDetector(SemanticVadParams(eagerness), Model(0.7, 0.7))  # type: ignore[arg-type]
        start, stopped = run(d, speech(320) + quiet(wait + 320))[1]
        assert stopped == SpeechStopped(320)
        assert start + W - 320 == pytest.approx(wait, abs=W), eagerness


def test_an_unfinished_sounding_turn_ends_after_the_eagernesss_longest_wait() -> None:
    for eagerness, wait in (("low", 8000), ("medium", 4000), ("auto", 4000), ("high", 2000)):
        model = Model(0.0, 0.0)
        d = SemanticTurnDetector(SemanticVadParams(eagerness), model)  # type: ignore[arg-type]
        events = run(d, speech(320) + quiet(wait + 320))
        start, stopped = events[1]
        assert stopped == SpeechStopped(320)
        assert start + W - 320 == pytest.approx(wait, abs=W), eagerness
        assert len(model.asked) == (2 if eagerness == "high" else 1)


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
    run(d, speech(320) + quiet(CHECK_MS - LEAD_MS - W))  # a silence, not yet asked about
    assert d.speaking and d.silence_from == 320
    d.reset()
    assert not d.speaking and d.silence_from is None
    assert run(d, speech(64))[0][1] == SpeechStarted(0)
    with pytest.raises(ValueError, match="overlaps"):
        d.push(0.9, 0, W)
    with pytest.raises(BadRequestError) as info:
        SemanticVadParams("eager")  # type: ignore[arg-type]
    assert info.value.param == "eagerness"


# ------------------------------------------------------------- verdicts that come late


def test_a_late_verdict_ends_the_turn_where_its_silence_began() -> None:
    d = SemanticTurnDetector(SemanticVadParams())  # no judge: questions are taken
    events = run(d, speech(320) + quiet(320))
    assert [type(e) for _, e in events] == [SpeechStarted]  # asked, not yet answered
    question = d.take_question()
    assert question is not None and d.take_question() is None
    assert (question.start_ms, question.end_ms) == (0, 320 + CHECK_MS)
    # The silence went on 320 ms - CHECK_MS before the verdict came: the turn ends at once,
    # where the silence began, as it would have ended at the question.
    assert d.wants(question.token)
    assert d.verdict(question.token, 0.99) == SpeechStopped(320)
    assert not d.speaking and not d.wants(question.token)
    assert d.last_verdict == (0.99, question.end_ms)


def test_a_late_unsure_verdict_counts_its_wait_from_the_silences_start() -> None:
    d = SemanticTurnDetector(SemanticVadParams("medium"))  # likely finished: 1000 ms
    run(d, speech(320) + quiet(704))
    question = d.take_question()
    assert question is not None
    assert d.verdict(question.token, 0.7) is None  # 704 ms of silence so far
    assert d.verdict(question.token, 0.99) is None  # one verdict per question
    events = run(d, quiet(320), at=320 + 704)
    # The first window to end 1000 ms into the silence ends the turn.
    assert events == [(320 + 1000 + W - 40, SpeechStopped(320))]


def test_a_verdict_on_a_silence_that_is_over_is_dropped() -> None:
    d = SemanticTurnDetector(SemanticVadParams())
    run(d, speech(320) + quiet(256))
    first = d.take_question()
    assert first is not None
    run(d, speech(96), at=576)  # the user went on before the verdict came
    assert not d.wants(first.token) and d.verdict(first.token, 1.0) is None
    assert d.speaking
    run(d, quiet(256), at=672)
    second = d.take_question()
    assert second is not None and second.token != first.token
    assert d.verdict(first.token, 1.0) is None  # out of order: the old one still loses
    assert d.verdict(second.token, 1.0) == SpeechStopped(672)
    d2 = SemanticTurnDetector(SemanticVadParams())
    run(d2, speech(320) + quiet(256))
    q = d2.take_question()
    assert q is not None
    d2.reset()
    assert d2.verdict(q.token, 1.0) is None and d2.take_question() is None


def test_a_verdict_that_never_comes_ends_the_turn_on_the_longest_wait() -> None:
    d = SemanticTurnDetector(SemanticVadParams("high"))
    events = run(d, speech(320) + quiet(2000 + 64))
    assert events[-1] == (2304, SpeechStopped(320))  # the first window to end 2000 ms in
    assert d.take_question() is None  # its question went with the turn


def test_high_eagerness_asks_early_and_an_unsure_early_verdict_waits_for_the_deciding_one() -> None:
    # Sure at FIRST_CHECK_MS: the turn ends there, where its silence began.
    model = Model(0.95)
    d = SemanticTurnDetector(SemanticVadParams("high"), model)
    start, stopped = run(d, speech(320) + quiet(640))[1]
    assert stopped == SpeechStopped(320) and model.asked == [(0, 320 + FIRST_CHECK_MS)]
    assert start + W - 320 == FIRST_CHECK_MS
    # Sure only at CHECK_MS: asked twice, the turn ends at the second.
    model = Model(0.8, 0.95)
    d = SemanticTurnDetector(SemanticVadParams("high"), model)
    start, stopped = run(d, speech(320) + quiet(640))[1]
    assert stopped == SpeechStopped(320) and len(model.asked) == 2
    assert start + W - 320 == CHECK_MS
    # Unsure at both: the deciding verdict's wait ("likely finished": 500 ms for high).
    model = Model(0.8, 0.7)
    d = SemanticTurnDetector(SemanticVadParams("high"), model)
    start, stopped = run(d, speech(320) + quiet(1000))[1]
    assert stopped == SpeechStopped(320) and len(model.asked) == 2
    assert start + W - 320 == pytest.approx(500, abs=W)
    # The other eagernesses ask once, at CHECK_MS.
    assert SemanticVadParams("auto").first_check_ms == CHECK_MS
    assert SemanticVadParams("low").first_check_ms == CHECK_MS


# ------------------------------------------------------------- asked ahead (LEAD_MS)


def test_the_model_is_asked_ahead_and_the_turn_ends_only_when_the_silence_gets_there() -> None:
    d = SemanticTurnDetector(SemanticVadParams())
    assert CHECK_MS - LEAD_MS == 2 * W
    run(d, speech(320) + quiet(CHECK_MS - LEAD_MS))
    question = d.take_question()
    # Asked with 64 ms of silence heard, about the silence at CHECK_MS.
    assert question is not None and question.end_ms == 320 + CHECK_MS
    # A sure verdict in before the silence gets there waits for it...
    assert d.verdict(question.token, 0.99) is None and d.speaking
    assert run(d, quiet(W), at=320 + CHECK_MS - LEAD_MS) == []
    # ... and the window that brings the silence to CHECK_MS ends the turn where it began.
    assert run(d, quiet(W), at=320 + CHECK_MS - W) == [(320 + CHECK_MS - W, SpeechStopped(320))]


def test_speech_after_an_early_sure_verdict_keeps_the_turn() -> None:
    d = SemanticTurnDetector(SemanticVadParams())
    run(d, speech(320) + quiet(CHECK_MS - LEAD_MS))
    question = d.take_question()
    assert question is not None
    assert d.verdict(question.token, 0.99) is None
    # The user goes on before the silence lasts CHECK_MS: no cut-off, and the next pause
    # is asked about afresh.
    assert run(d, speech(96) + quiet(W), at=320 + CHECK_MS - LEAD_MS) == []
    assert d.speaking and not d.wants(question.token)


def _likely_verdict(d: SemanticTurnDetector) -> int:
    """A turn paused 320 ms in, its deciding question taken: the question's token."""
    run(d, speech(320) + quiet(320))
    question = d.take_question()
    assert question is not None
    return question.token


def test_words_that_end_a_sentence_end_a_likely_finished_turn_at_once() -> None:
    # The verdict first, then the words.
    d = SemanticTurnDetector(SemanticVadParams())
    token = _likely_verdict(d)
    assert d.verdict(token, 0.7) is None  # likely finished: it would wait 1000 ms
    assert d.words(320, WORDS_END) == SpeechStopped(320)  # where its silence began
    assert not d.speaking
    # The words first, then the verdict.
    d = SemanticTurnDetector(SemanticVadParams())
    token = _likely_verdict(d)
    assert d.words(320, 0.6) is None  # no verdict from the model yet
    assert d.verdict(token, 0.7) == SpeechStopped(320)


def test_words_that_do_not_end_a_sentence_keep_the_wait() -> None:
    for verdict, words, wait in ((0.7, WORDS_END / 2, 1000), (0.3, WORDS_END_LATE / 2, 4000)):
        d = SemanticTurnDetector(SemanticVadParams())
        token = _likely_verdict(d)
        assert d.verdict(token, verdict) is None
        assert d.words(320, words) is None
        start, stopped = run(d, quiet(wait), at=640)[0]
        assert stopped == SpeechStopped(320)
        assert start + W - 320 == pytest.approx(wait, abs=W), (verdict, words)


def _every_question_judged(eagerness: str, verdict: float) -> tuple[SemanticTurnDetector, int]:
    """A turn paused 320 ms in, every question on the pause ("high" asks twice) given
    ``verdict`` and none ending it: the detector, and the ms of audio fed so far."""
    d = SemanticTurnDetector(SemanticVadParams(eagerness))  # type: ignore[arg-type]
    run(d, speech(320) + quiet(160))
    at = 480
    while (question := d.take_question()) is not None:
        assert d.verdict(question.token, verdict) is None
        run(d, quiet(64), at=at)
        at += 64
    return d, at


def test_words_that_end_a_sentence_shorten_an_unfinished_sounding_turns_wait() -> None:
    # The end of a sentence said with a pause in it: Smart Turn hears it unfinished, the
    # words may end a sentence (at least WORDS_END_LATE, below the WORDS_END that ends a
    # likely one at once). It waits the unsure second, not the longest silence.
    assert WORDS_END_LATE < WORDS_END
    for eagerness in ("medium", "high"):
        eager = EAGERNESS[eagerness]
        d, at = _every_question_judged(eagerness, 0.3)
        assert d.words(320, min(eager.words_end or 0, WORDS_END_LATE)) is None
        start, stopped = run(d, quiet(eager.max_wait_ms), at=at)[0]
        assert stopped == SpeechStopped(320)
        assert start + W - 320 == pytest.approx(eager.unsure_wait_ms, abs=W), eagerness
    # "low" hears no words: the longest silence stands.
    d = SemanticTurnDetector(SemanticVadParams("low"), Model(0.3))
    run(d, speech(320) + quiet(CHECK_MS))
    assert d.words(320, 0.99) is None
    assert run(d, quiet(EAGERNESS["low"].unsure_wait_ms), at=320 + CHECK_MS) == []
    assert d.speaking


def test_words_of_a_silence_that_is_over_are_dropped_and_low_eagerness_ignores_words() -> None:
    d = SemanticTurnDetector(SemanticVadParams())
    token = _likely_verdict(d)
    assert d.words(999, 0.9) is None  # another silence's
    assert d.verdict(token, 0.7) is None  # so the wait stands
    run(d, speech(96), at=640)  # the user went on
    assert d.words(320, 0.9) is None and d.speaking
    low = SemanticTurnDetector(SemanticVadParams("low"))
    token = _likely_verdict(low)
    assert low.verdict(token, 0.9) is None
    assert low.words(320, 0.9) is None and low.speaking  # "low" waits its 2000 ms


def test_high_eagerness_takes_less_sure_words() -> None:
    for eagerness, ended in (("medium", False), ("high", True)):
        d, _ = _every_question_judged(eagerness, 0.6)
        assert (d.words(320, WORDS_END_EAGER) is not None) == ended, eagerness


def test_the_words_are_wanted_only_while_the_deciding_verdict_is_unsure() -> None:
    for verdict, wanted in ((0.7, True), (0.99, False), (0.3, None)):
        d = SemanticTurnDetector(SemanticVadParams())
        run(d, speech(320) + quiet(W))
        assert d.words_wanted(320) is None  # silent, not yet judged
        run(d, quiet(CHECK_MS - LEAD_MS - W), at=320 + W)
        question = d.take_question()
        assert question is not None and d.words_wanted(320) is None  # asked, no verdict
        d.verdict(question.token, verdict)
        assert d.words_wanted(320) is wanted, verdict
        assert d.words_wanted(288) is False  # another silence's words: stale
    # Unfinished-sounding (the last verdict, 0.3): wanted once the pause has lasted.
    asked_at = 320 + CHECK_MS - LEAD_MS  # the audio so far
    run(d, quiet(320 + WORDS_LATE_MS - W - asked_at), at=asked_at)
    assert d.words_wanted(320) is None  # a pause for breath, maybe
    run(d, quiet(W), at=320 + WORDS_LATE_MS - W)
    assert d.words_wanted(320) is True
    d.push(0.9, 320 + WORDS_LATE_MS, 320 + WORDS_LATE_MS + W)  # the user went on
    assert d.words_wanted(320) is False
    # "high"'s first question, not sure: the deciding one is still to come.
    d = SemanticTurnDetector(SemanticVadParams("high"))
    run(d, speech(320) + quiet(W))
    question = d.take_question()
    assert question is not None and not question.final
    d.verdict(question.token, 0.7)
    assert d.words_wanted(320) is None
    # "low" does not hear words.
    d = SemanticTurnDetector(SemanticVadParams("low"), Model(0.7))
    run(d, speech(320) + quiet(CHECK_MS))
    assert d.speaking and d.words_wanted(320) is False
