"""whisper_short's pure parts: the loop check on token ids, the prompt it builds, and the
``max_length`` it asks CTranslate2 for (no model here; tests/models has the real one)."""

from __future__ import annotations

import pytest

from omnistage.engines.speech.whisper_short import _max_length, _prompt, _repeats

SOT_PREV, SOT, NO_TIMESTAMPS = 50361, 50257, 50362


class Tokenizer:
    """What ``_prompt`` reads of faster-whisper's Tokenizer: a word per token id."""

    sot_prev = SOT_PREV
    sot_sequence = (SOT,)
    no_timestamps = NO_TIMESTAMPS

    def encode(self, text: str) -> list[int]:
        return [1000 + len(word) for word in text.split()]


@pytest.mark.parametrize("period", [1, 2, 3, 5, 8])
def test_a_loop_of_any_period_is_caught(period: int) -> None:
    run = list(range(100, 100 + period))
    assert _repeats([7, 8, 9] + run * 4)
    assert _repeats(run * 4)


@pytest.mark.parametrize("period", [2, 3, 5])
def test_a_loop_cut_mid_run_by_max_length_is_caught(period: int) -> None:
    run = list(range(100, 100 + period))
    for cut in range(1, period):
        assert _repeats([7, 8] + run * 3 + run[:cut])


def test_a_phrase_said_twice_is_taken_for_a_loop() -> None:
    # "Hello? Hello?": two runs of two tokens. The short path falls back to the full
    # window, which costs time, not words.
    assert _repeats([15496, 30, 15496, 30])


def test_one_token_needs_four_in_a_row() -> None:
    assert not _repeats([40, 1807, 1807])  # "that that"
    assert not _repeats([40, 1807, 1807, 1807])
    assert _repeats([40, 1807, 1807, 1807, 1807])
    assert _repeats([13, 13, 13, 13])  # "...." alone


@pytest.mark.parametrize(
    "tokens",
    [
        [],
        [314],
        [314, 561, 588, 284, 1492, 257, 3084, 329, 734, 661, 379, 3598, 267, 6, 15750, 13],
        [3363, 13],  # "Yes."
        [3363, 11, 3363, 11, 314, 1101, 1654, 13],  # "Yes, yes, I'm sure." mid-text repeat
        [383, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13],
        [40, 1807, 1807, 262, 3290, 13],
    ],
)
def test_ordinary_text_is_not_a_loop(tokens: list[int]) -> None:
    assert not _repeats(tokens)


def test_the_prompt_without_previous_text() -> None:
    assert _prompt(Tokenizer(), None) == [SOT, NO_TIMESTAMPS]
    assert _prompt(Tokenizer(), "") == [SOT, NO_TIMESTAMPS]


def test_the_prompt_with_previous_text() -> None:
    assert _prompt(Tokenizer(), "  hi there ") == [SOT_PREV, 1002, 1005, SOT, NO_TIMESTAMPS]


def test_previous_text_keeps_its_last_223_tokens() -> None:
    words = " ".join("x" * (1 + i % 9) for i in range(300))
    out = _prompt(Tokenizer(), words)
    assert len(out) == 1 + 223 + 2
    assert out[1:-2] == Tokenizer().encode(words)[-223:]


@pytest.mark.parametrize("prompt_len", [2, 8, 23, 43, 226])
@pytest.mark.parametrize("budget", [12, 24, 92])
def test_max_length_leaves_the_whole_budget_after_any_prompt(prompt_len: int, budget: int) -> None:
    length = _max_length(prompt_len, budget)
    # What CTranslate2 4.x's Whisper generates at most for max_length L (measured).
    assert min(length // 2, length - prompt_len + 1) >= budget
    assert length <= 448  # the decoder's positions
