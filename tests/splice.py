"""A pause spliced into a spoken sentence where its first words end.

The turn-taking tests and benches say "I would like to ... book a table" as one sentence
(so the first words keep the sentence's run-on intonation) and splice silence in where
"I would like to" ends. Where that is must be found in the whole sentence: the first
words said alone take longer (a phrase's last word is drawn out), so their length
overshoots, often into the next word ("Please remind me to call my f-"), and a sentence
cut mid-word tests something else. The first words said alone are aligned to the start
of the whole sentence instead (dynamic time warping on log band energies: the same voice
saying the same words, so the alignment is close), and the cut goes at the quietest
10 ms near where they end.
"""

from __future__ import annotations

import itertools

import numpy as np

BANDS = 40
NEAR_MS = 40  # how far from the aligned end the quietest point is looked for


def _features(pcm: np.ndarray, rate: int) -> np.ndarray:
    """Per 10 ms frame, normalized log energies in ``BANDS`` log-spaced bands."""
    x = pcm.astype(np.float32)
    win, hop = int(0.025 * rate), rate // 100
    count = 1 + max(0, (len(x) - win) // hop)
    frames = np.stack([x[i * hop : i * hop + win] for i in range(count)]) * np.hanning(win)
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2
    edges = np.geomspace(2, power.shape[1] - 1, BANDS + 1).astype(int)
    bands = np.stack([power[:, a : b + 1].sum(1) for a, b in itertools.pairwise(edges)], 1)
    logs = np.log(bands + 1e-8)
    return (logs - logs.mean(0)) / (logs.std(0) + 1e-5)


def aligned_end(alone: np.ndarray, whole: np.ndarray, rate: int) -> int:
    """The sample of ``whole`` where ``alone`` (its first words, said alone) ends: the
    end of the best time warping of all of ``alone`` onto a prefix of ``whole``."""
    a, w = _features(alone, rate), _features(whole, rate)
    cost = ((a[:, None, :] - w[None, :, :]) ** 2).sum(-1)
    rows, cols = cost.shape
    total = np.full((rows + 1, cols + 1), np.inf)
    total[0, 0] = 0.0
    for i in range(1, rows + 1):
        above = total[i - 1]
        for j in range(1, cols + 1):
            best = min(above[j], total[i, j - 1], above[j - 1])
            total[i, j] = cost[i - 1, j - 1] + best
    end = int(np.argmin(total[rows, 1:]))
    # A drawn-out sound matches its last frame equally well anywhere along it, and the
    # warping takes the earliest: go on while the whole still sounds like that frame.
    last = cost[rows - 1]
    alike = 2 * last[end] + 1e-3
    while end + 1 < cols and last[end + 1] <= alike:
        end += 1
    return (end + 1) * (rate // 100)


def cut_point(alone: np.ndarray, whole: np.ndarray, rate: int) -> int:
    """Where to splice a pause into ``whole`` after its first words (``alone``): the
    middle of the quietest 10 ms within ``NEAR_MS`` of where they end."""
    end = aligned_end(alone, whole, rate)
    block, step = rate // 100, rate // 400
    near = NEAR_MS * rate // 1000
    starts = range(max(0, end - near), max(1, min(len(whole) - block, end + near)), step)
    quietest = min(
        starts, key=lambda i: float(np.abs(whole[i : i + block].astype(np.float32)).mean())
    )
    return quietest + block // 2
