"""How the TTS engine cuts what it speaks (engines/speech/sentences.py), without audio."""

from __future__ import annotations

import pytest

from omnistage.engines.speech.sentences import (
    SpokenBefore,
    StreamedPieces,
    SynthesisPace,
    prompt_pieces,
)


def test_a_prompt_is_spoken_by_sentence_or_whole() -> None:
    text = "Hello there. How are you? Fine"
    assert prompt_pieces(text, sentence_streaming=True) == ["Hello there.", "How are you?", "Fine"]
    assert prompt_pieces(text, sentence_streaming=False) == [text]
    assert prompt_pieces("  ", sentence_streaming=True) == []
    assert prompt_pieces("  ", sentence_streaming=False) == []


def test_streamed_text_goes_out_by_sentence_with_an_opening_clause_first() -> None:
    pieces = StreamedPieces(sentence_streaming=True, first_phrase=False)
    assert pieces.add("The ocean is vast and deep,") == []  # the clause is not complete yet
    assert pieces.add(" teeming") == ["The ocean is vast and deep,"]
    assert pieces.add(" with life. And") == ["teeming with life."]
    # Once something was said, only whole sentences go.
    assert pieces.add(" then the tide came in, slowly") == []
    assert pieces.rest() == "And then the tide came in, slowly"


def test_without_sentence_streaming_everything_waits_for_the_end() -> None:
    pieces = StreamedPieces(sentence_streaming=False, first_phrase=True)
    assert pieces.add("One. Two. ") == []
    assert pieces.add("Three") == []
    assert pieces.rest() == "One. Two. Three"


def test_a_retry_skips_the_pieces_spoken_before_and_cuts_a_straddling_one() -> None:
    before = SpokenBefore("Hello there.How are you?")
    assert before.skip("Hello there.") and before.skip("How are you?")
    assert not before.skip("Fine.")  # new: spoken, its text whole
    assert before.new_text("Fine.") == "Fine."
    # Pieces cut differently this time: the text the client has is not sent again.
    odd = SpokenBefore("Hello there, how")
    assert not odd.skip("Hello there, how are you?")
    assert odd.new_text("Hello there, how are you?") == " are you?"
    assert odd.new_text("Next.") == "Next."
    assert not SpokenBefore("").skip("Hello.")


def test_the_opening_phrase_spoken_alone_is_named() -> None:
    pieces = StreamedPieces(sentence_streaming=True, first_phrase=True)
    assert pieces.add("The capital of France is ") == ["The capital of France"]
    assert pieces.opening == "The capital of France"
    whole = StreamedPieces(sentence_streaming=True, first_phrase=True)
    assert whole.add("Paris. And") == ["Paris."] and whole.opening is None


def test_the_opening_goes_alone_only_while_synthesis_is_fast() -> None:
    pace = SynthesisPace(floor=0.1, weight=0.5)
    assert pace.opening_alone()  # nothing measured: an idle machine
    pace.record(0.05, 2.0)  # 40x real time
    assert pace.opening_alone()
    pace.record(1.0, 2.0)  # busy cores: 2x real time
    assert not pace.opening_alone()
    for _ in range(6):
        pace.record(0.05, 2.0)
    assert pace.opening_alone()  # fast again: the moving average follows
    pace.record(1.0, 0.0)  # no audio: nothing to learn
    assert pace.opening_alone()


def test_an_unfinished_sentence_is_cut_at_a_phrase_boundary_when_asked() -> None:
    pieces = StreamedPieces(sentence_streaming=True, first_phrase=True)
    assert pieces.add("The fruit that is yellow ") == ["The fruit that"]  # the opening
    assert pieces.add("is a lemon, a kind of citrus fruit which ") == []
    assert pieces.pending == len("is yellow is a lemon, a kind of citrus fruit which")
    assert pieces.phrase() == ["is yellow is a lemon,"]
    assert pieces.phrase() == ["a kind of citrus fruit"]
    assert pieces.phrase() == []  # "which": no words after a boundary yet
    assert pieces.add("grows on trees. More") == ["which grows on trees."]


def test_busy_is_measured_against_the_machines_own_idle_speed() -> None:
    fast = SynthesisPace(weight=0.5)  # the defaults: floor 0.1, 2x idle, ceiling 0.2
    fast.record(0.05, 2.0)  # 40x real time idle: twice that is under the floor
    assert fast.limit == pytest.approx(0.1)
    for _ in range(3):
        fast.record(0.3, 2.0)  # 0.15 s/s: a busy fast machine holds the opening
    assert fast.ratio > 0.1 and not fast.opening_alone()

    slow = SynthesisPace(weight=0.5)
    for _ in range(4):
        slow.record(0.24, 2.0)  # 8x real time idle (a slower CPU)
    assert slow.ratio == pytest.approx(0.12, abs=0.01)
    assert slow.limit == pytest.approx(0.2)  # twice its idle pace is 0.24: the ceiling
    assert slow.opening_alone()  # idle, though slower than a fixed 0.1
    for _ in range(4):
        slow.record(0.5, 2.0)  # 4x real time, half its idle speed: busy
    assert not slow.opening_alone()
    assert slow.best == pytest.approx(0.12)  # the idle speed is the fastest seen
