"""The test helper that splices a pause into a sentence where its first words end."""

from __future__ import annotations

import numpy as np

from tests.splice import aligned_end, cut_point

RATE = 16_000


def _tone(hz: float, seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def _gap(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), dtype=np.float32)


def test_the_first_words_said_slower_alone_are_found_where_they_end_in_the_whole() -> None:
    # "Words" as tones: alone, the last one is drawn out (as a phrase's last word is);
    # in the whole sentence it is shorter and the next one follows a short gap.
    alone = np.concatenate([_tone(300, 0.2), _tone(900, 0.35)])
    first_words = np.concatenate([_tone(300, 0.2), _tone(900, 0.2)])
    whole = np.concatenate([first_words, _gap(0.03), _tone(2000, 0.4)])
    assert abs(aligned_end(alone, whole, RATE) - len(first_words)) <= 0.03 * RATE
    # The cut falls in the gap, not in either word; the length alone would cut the
    # next word.
    cut = cut_point(alone, whole, RATE)
    assert len(first_words) <= cut <= len(first_words) + 0.03 * RATE
    assert len(alone) > len(first_words) + 0.03 * RATE
