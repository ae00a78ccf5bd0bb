"""The talker's order across answers: deadline first where a listener is about to run
dry, then first chunks, then the rest by when each is due (``DeadlineOrder``)."""

from __future__ import annotations

from omnistage.engines.speech.talker_order import ChunkOrder, DeadlineOrder, Piece, Playback


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def playing(clock: Clock, started_ago: float, sent_s: float) -> Playback:
    playback = Playback()
    playback.sent(sent_s, clock.now - started_ago)
    return playback


def test_playback_is_due_when_the_audio_sent_has_played_out() -> None:
    playback = Playback()
    assert playback.due is None
    playback.sent(1.5, now=10.0)
    playback.sent(2.0, now=11.0)
    assert playback.due == 13.5


def test_a_later_chunk_about_to_run_dry_goes_before_first_chunks() -> None:
    clock = Clock()
    order = DeadlineOrder(clock, guard_s=0.3, char_s=0.004)
    first = Piece(Playback(), 0, 20)
    dry = Piece(playing(clock, started_ago=0.8, sent_s=1.0), 1, 25)  # 0.2 s left
    relaxed = Piece(playing(clock, started_ago=0.1, sent_s=3.0), 1, 25)  # 2.9 s left
    ranked = sorted([relaxed, first, dry], key=order.key)
    assert ranked == [dry, first, relaxed]


def test_slack_shrinks_as_the_clock_runs_so_a_waiting_chunk_grows_urgent() -> None:
    clock = Clock()
    order = DeadlineOrder(clock, guard_s=0.3, char_s=0.004)
    first = Piece(Playback(), 0, 20)
    later = Piece(playing(clock, started_ago=0.0, sent_s=1.2), 1, 25)  # 1.1 s to spare
    assert min([later, first], key=order.key) is first
    clock.now += 0.9
    assert min([later, first], key=order.key) is later


def test_later_chunks_go_by_due_time_and_first_chunks_in_order_of_asking() -> None:
    clock = Clock()
    order = DeadlineOrder(clock)
    a, b = Piece(Playback(), 0, 10), Piece(Playback(), 0, 10)
    soon = Piece(playing(clock, 0.0, 2.0), 1, 10)
    late = Piece(playing(clock, 0.0, 5.0), 2, 10)
    assert sorted([late, b, soon, a], key=order.key) == [a, b, soon, late]


def test_only_chunks_with_seconds_to_spare_run_niced() -> None:
    clock = Clock()
    order = DeadlineOrder(clock, nice_slack_s=2.0, char_s=0.004)
    assert not order.niced(Piece(Playback(), 0, 50))
    assert not order.niced(Piece(playing(clock, 0.0, 1.5), 1, 50))
    assert order.niced(Piece(playing(clock, 0.0, 4.0), 3, 50))


def test_an_answer_about_to_run_dry_is_told_to_hurry() -> None:
    clock = Clock()
    order = DeadlineOrder(clock, hurry_s=0.5, char_s=0.004)
    playback = playing(clock, started_ago=0.0, sent_s=2.0)
    assert not order.hurry(Playback(), 40)  # nothing sent yet: the opening has its own cut
    assert not order.hurry(playback, 40)  # 2 s ahead
    clock.now += 1.5  # 0.5 s left, 0.16 s of synthesis pending
    assert order.hurry(playback, 40)


def test_the_synthesis_rate_follows_what_syntheses_took() -> None:
    order = DeadlineOrder(Clock(), char_s=0.004)
    for _ in range(30):
        order.observe(100, 1.0)  # a loaded machine: 10 ms a character
    assert abs(order.char_s - 0.01) < 0.0005
    order.observe(0, 1.0)  # nothing to learn from an empty piece
    assert abs(order.char_s - 0.01) < 0.0005


def test_chunk_order_puts_first_chunks_first_and_nices_from_the_third() -> None:
    order = ChunkOrder()
    pieces = [Piece(Playback(), i, 10) for i in (2, 1, 0)]
    assert [p.index for p in sorted(pieces, key=order.key)] == [0, 2, 1]
    assert [order.niced(p) for p in pieces] == [True, False, False]
    assert not order.hurry(Playback(), 10)
