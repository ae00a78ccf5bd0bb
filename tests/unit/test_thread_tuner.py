"""The step loop's torch thread count: the pure policy, fed step times."""

from __future__ import annotations

import itertools

import pytest

from omnistage.engines.torch_threads import ThreadTuner, thread_ladder


def test_the_ladder_doubles_up_to_the_cores() -> None:
    assert thread_ladder(1) == (1,)
    assert thread_ladder(2) == (1, 2)
    assert thread_ladder(6) == (1, 2, 4, 6)
    assert thread_ladder(8) == (1, 2, 4, 8)


def feed(tuner: ThreadTuner, times: dict[int, float], steps: int, rows: int = 8) -> list[int]:
    """Run ``steps`` decode steps whose time depends on the count they ran on."""
    counts = []
    count = tuner.count
    for _ in range(steps):
        counts.append(count)
        count = tuner.observe(rows, times[count])
    return counts


def test_it_starts_on_one_thread_and_moves_up_when_two_are_faster() -> None:
    tuner = ThreadTuner((1, 2), window=4, period=10)
    assert tuner.count == 1
    counts = feed(tuner, {1: 0.010, 2: 0.007}, 20)
    # 10 steps on one thread, then a 4-step trial on two that wins.
    assert counts[:10] == [1] * 10
    assert counts[10:14] == [2] * 4
    assert tuner.count == 2 and tuner.moves == 1
    assert counts[14:] == [2] * 6


def test_a_losing_trial_costs_one_step_and_backs_off() -> None:
    tuner = ThreadTuner((1, 2), window=4, period=10, max_period=40)
    # Two threads on a busy machine: far slower (abort at 3x the baseline).
    counts = feed(tuner, {1: 0.010, 2: 0.500}, 200)
    assert tuner.count == 1
    trials = [i for i, c in enumerate(counts) if c == 2]
    # Each trial ran one step; the waits between them doubled up to max_period.
    gaps = [b - a for a, b in itertools.pairwise(trials)]
    assert trials[0] == 10
    assert gaps[:3] == [21, 41, 41]
    assert tuner.period == 40


def test_a_trial_within_the_margin_does_not_move() -> None:
    tuner = ThreadTuner((1, 2), window=4, period=10, margin=0.05)
    feed(tuner, {1: 0.010, 2: 0.0098}, 40)
    assert tuner.count == 1 and tuner.moves == 0


def test_a_trial_is_dropped_when_the_batch_changes() -> None:
    tuner = ThreadTuner((1, 2), window=4, period=4)
    assert [tuner.observe(8, 0.010) for _ in range(4)] == [1, 1, 1, 2]  # a trial begins
    assert tuner.observe(3, 0.001) == 1  # another batch: not comparable, back, no verdict
    assert tuner.count == 1 and tuner.moves == 0 and tuner.period == 4


def test_on_more_threads_a_sudden_slow_step_drops_a_rung() -> None:
    tuner = ThreadTuner((1, 2, 4), window=4, period=5)
    times = {1: 0.030, 2: 0.020, 4: 0.010}
    count = tuner.count
    while tuner.count != 4:
        count = tuner.observe(8, times[count])
    for _ in range(3):  # steady on 4 threads, no trial due yet
        assert tuner.observe(8, times[4]) == 4
    # The machine gets busy: the next step on 4 threads takes 10x.
    assert tuner.observe(8, 0.100) == 2
    assert tuner.count == 2


def test_each_shape_learns_its_own_count() -> None:
    tuner = ThreadTuner((1, 2), window=4, period=6)
    # One row: threads do not pay (overhead); eight rows: two threads are faster.
    times = {(1, 1): 0.010, (1, 2): 0.012, (8, 1): 0.030, (8, 2): 0.020}
    count = tuner.count
    for i in range(400):
        rows = 1 if (i // 10) % 2 == 0 else 8  # ten steps of one, then of the other
        count = tuner.observe(rows, times[(rows, count)])
    assert tuner.count_for(1) == 1
    assert tuner.count_for(8) == 2
    # Not seen: the nearest seen shape's count.
    assert tuner.count_for(3) == 1 and tuner.count_for(6) == 2


def test_a_new_shape_starts_on_the_nearest_seen_shapes_count() -> None:
    tuner = ThreadTuner((1, 2), window=4, period=4)
    assert tuner.count_for(5) == 1  # nothing seen yet: one thread
    count = tuner.count
    while tuner.count_for(8) != 2:
        count = tuner.observe(8, {1: 0.030, 2: 0.020}[count])
    # Seven rows, never seen: on eight rows' two threads from its first step.
    assert tuner.observe(7, 0.019) == 2
    assert tuner.count_for(7) == 2 and tuner.moves == 1


def test_a_new_shapes_first_step_on_another_count_is_not_its_sample() -> None:
    tuner = ThreadTuner((1, 2), window=4, period=4)
    assert [tuner.observe(1, 0.010) for _ in range(3)] == [1, 1, 1]  # one row, no trial yet
    count = tuner.count
    while tuner.count_for(8) != 2:
        count = tuner.observe(8, {1: 0.030, 2: 0.020}[count])
    # A two-row step that ran on eight rows' two threads, though two rows start on
    # one row's one thread (the nearest): switch to one, drop it.
    assert tuner.observe(2, 0.5) == 1
    # The two-row shape then needs its own full window before its first trial.
    assert [tuner.observe(2, 0.010) for _ in range(4)] == [1, 1, 1, 2]


def test_an_empty_ladder_is_an_error() -> None:
    with pytest.raises(ValueError):
        ThreadTuner(())
