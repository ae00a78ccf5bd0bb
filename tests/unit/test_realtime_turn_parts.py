"""The session's small parts: the gate holding an early answer, the input buffer on the
session's audio clock, and a user turn heard phrase by phrase."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from omnistage.realtime import events as ev
from omnistage.realtime.conversation import message_item
from omnistage.realtime.gate import Gate
from omnistage.realtime.input_buffer import BYTES_PER_MS, InputBuffer
from omnistage.realtime.user_turn import UserTurn
from tests.unit.fakes import ticks, until

# ------------------------------------------------------------------------ gate


def gated() -> tuple[Gate, list[Any]]:
    seen: list[Any] = []
    gate = Gate(seen.append, seen.append)
    return gate, seen


def deleted(item_id: str) -> ev.ItemDeleted:
    return ev.ItemDeleted(item_id=item_id)


def test_the_gate_holds_in_order_until_opened() -> None:
    gate, seen = gated()
    item = message_item("assistant", [])
    gate.emit(deleted("a"))
    gate.add_item(item)
    gate.emit(deleted("b"))
    assert seen == [] and not gate.is_open and gate.opened_at is None
    gate.open()
    assert seen == [deleted("a"), item, deleted("b")]
    assert gate.is_open and gate.opened_at is not None
    gate.emit(deleted("c"))  # open: straight through
    assert seen[-1] == deleted("c")


def test_a_dropped_gate_forgets_what_it_held() -> None:
    gate, seen = gated()
    gate.emit(deleted("a"))
    gate.add_item(message_item("assistant", []))
    gate.drop()
    gate.emit(deleted("b"))
    gate.open()
    assert seen == [deleted("b")]


# ------------------------------------------------------------------------ input buffer


def ms_of(n: int, value: int = 0) -> bytes:
    """``n`` ms of 24 kHz pcm16, each sample the same 16-bit value."""
    return value.to_bytes(2, "little") * int(n * BYTES_PER_MS / 2)


def test_the_buffer_slices_by_session_time() -> None:
    buf = InputBuffer()
    buf.append(ms_of(100, 1) + ms_of(100, 2))
    assert buf.end_ms == 200 and len(buf) == 200 * BYTES_PER_MS
    assert buf.slice(100) == ms_of(100, 2)
    assert buf.slice(50, 150) == ms_of(50, 1) + ms_of(50, 2)
    assert buf.slice(-10, 10) == ms_of(10, 1)  # clamped to what is held
    assert buf.slice(150, 100) == b""  # an end before the start is empty
    assert buf.slice(300) == b""


def test_slices_fall_on_whole_samples() -> None:
    buf = InputBuffer()
    buf.append(ms_of(10, 7))
    assert len(buf.slice(1 / 48)) % 2 == 0  # 1/48 ms is one byte: rounded to a sample


def test_drop_before_keeps_the_clock() -> None:
    buf = InputBuffer()
    buf.append(ms_of(100, 1) + ms_of(100, 2))
    buf.drop_before(100)
    assert buf.start_ms == 100 and buf.end_ms == 200
    assert buf.slice(100) == ms_of(100, 2)
    assert buf.slice(0, 150) == ms_of(50, 2)  # what was dropped is gone
    buf.append(ms_of(50, 3))
    assert buf.end_ms == 250 and buf.slice(200) == ms_of(50, 3)


def test_keep_last_and_clear() -> None:
    buf = InputBuffer()
    buf.append(ms_of(1000, 1) + ms_of(300, 2))
    buf.keep_last(300)
    assert buf.start_ms == 1000 and buf.slice(0) == ms_of(300, 2)
    buf.keep_last(500)  # more than it holds: nothing dropped
    assert buf.start_ms == 1000
    buf.clear()
    assert len(buf) == 0 and buf.start_ms == buf.end_ms == 1300


# ------------------------------------------------------------------------ user turn


class FakePhrase:
    """A ``TurnListener`` whose transcript the test releases."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.audio = bytearray()
        self.closed = False
        self.release = asyncio.Event()
        self.finishing = False

    def feed(self, pcm: bytes) -> None:
        self.audio += pcm

    async def finish(self) -> str:
        self.finishing = True
        await self.release.wait()
        return self.text

    def close(self) -> None:
        self.closed = True


class Phrases:
    """Hands out one ``FakePhrase`` per phrase, with the scripted transcripts in turn."""

    def __init__(self, *texts: str) -> None:
        self.texts = list(texts)
        self.made: list[FakePhrase] = []

    def __call__(self) -> FakePhrase:
        phrase = FakePhrase(self.texts[len(self.made)])
        self.made.append(phrase)
        return phrase


def make_turn(*texts: str) -> tuple[UserTurn, Phrases, list[str]]:
    phrases, pieces = Phrases(*texts), []
    turn = UserTurn("item_1", 500.0, phrases, pieces.append)  # type: ignore[arg-type]
    return turn, phrases, pieces


async def test_phrases_are_fed_and_transcribed_in_order() -> None:
    turn, phrases, pieces = make_turn("hello", "there", "friend")
    turn.feed(b"ab", 10)
    turn.feed(b"cd", 10)
    assert turn.in_phrase and turn.fed_ms == 520
    turn.end_phrase()
    assert not turn.in_phrase and turn.phrases == 1
    turn.end_phrase()  # no audio since: no new phrase
    assert turn.phrases == 1
    turn.feed(b"ef", 10)
    turn.end_phrase()
    turn.feed(b"gh", 10)
    assert [bytes(p.audio) for p in phrases.made] == [b"abcd", b"ef", b"gh"]
    # The second phrase's text comes first: it waits for the first's.
    phrases.made[1].release.set()
    await ticks()
    assert pieces == []
    phrases.made[0].release.set()
    heard = asyncio.ensure_future(turn.heard_so_far())
    await until(heard.done)
    assert heard.result() == "hello there"
    assert pieces == ["hello", " there"]  # deltas joined as the words were said
    transcript = asyncio.ensure_future(turn.transcript())  # ends the open phrase
    await until(lambda: phrases.made[2].finishing)
    phrases.made[2].release.set()
    await until(transcript.done)
    assert transcript.result() == "hello there friend"
    assert pieces == ["hello", " there", " friend"]


async def test_an_empty_first_phrase_leaves_no_leading_space() -> None:
    turn, phrases, pieces = make_turn("", "words")
    turn.feed(b"..", 10)
    turn.end_phrase()
    turn.feed(b"..", 10)
    task = asyncio.ensure_future(turn.transcript())
    for phrase in phrases.made:
        phrase.release.set()
    await until(task.done)
    assert task.result() == "words" and pieces == ["words"]


async def test_a_turn_without_a_listener_hears_nothing() -> None:
    turn = UserTurn("item_1", 0.0, lambda: None)
    turn.feed(b"..", 10)
    assert not turn.in_phrase and turn.fed_ms == 10
    assert await turn.transcript() == ""


async def test_a_failed_phrase_fails_the_transcript() -> None:
    class Broken(FakePhrase):
        async def finish(self) -> str:
            raise RuntimeError("listener down")

    turn = UserTurn("item_1", 0.0, lambda: Broken(""))
    turn.feed(b"..", 10)
    with pytest.raises(RuntimeError, match="listener down"):
        await turn.transcript()


async def test_close_frees_the_open_phrase_and_cancels_the_transcriptions() -> None:
    turn, phrases, pieces = make_turn("one", "two")
    turn.feed(b"..", 10)
    turn.end_phrase()
    turn.feed(b"..", 10)
    await until(lambda: phrases.made[0].finishing)
    turn.close()
    assert phrases.made[1].closed and not turn.in_phrase
    await ticks()
    phrases.made[0].release.set()
    with pytest.raises(asyncio.CancelledError):
        await turn.heard_so_far()
    assert pieces == []


async def test_a_guess_transcribes_the_phrase_as_its_pause_begins_and_the_pause_takes_it() -> None:
    turn, phrases, pieces = make_turn("(its own request)", "hello there")
    turn.feed(b"ab", 10)
    turn.feed(b"cd", 10)
    turn.guess()  # the user went quiet
    turn.guess()  # once per silence
    own, guess = phrases.made
    assert bytes(guess.audio) == b"abcd"
    await until(lambda: guess.finishing)  # transcribing before the pause has ended anything
    turn.feed(b"..", 10)  # the pause's silence goes to the phrase as before
    turn.end_phrase()
    assert own.closed and not own.finishing  # its own request is dropped: the guess has it
    guess.release.set()
    heard = asyncio.ensure_future(turn.heard_so_far())
    await until(heard.done)
    assert heard.result() == "hello there" and pieces == ["hello there"]


async def test_a_guess_is_dropped_when_the_user_goes_on() -> None:
    turn, phrases, _ = make_turn("hello there friend", "(the guess)")
    turn.feed(b"ab", 10)
    turn.guess()
    own, guess = phrases.made
    await until(lambda: guess.finishing)
    turn.unguess()  # a dip between words
    assert guess.closed and not own.closed
    turn.feed(b"cd", 10)
    turn.end_phrase()
    own.release.set()
    heard = asyncio.ensure_future(turn.heard_so_far())
    await until(heard.done)
    assert heard.result() == "hello there friend" and bytes(own.audio) == b"abcd"
    # A turn dropped with a guess open frees it too.
    turn2, phrases2, _ = make_turn("one", "two")
    turn2.feed(b"..", 10)
    turn2.guess()
    turn2.close()
    assert all(p.closed for p in phrases2.made)


async def test_a_guess_whose_words_come_while_its_silence_holds_is_told() -> None:
    told: list[UserTurn] = []
    phrases = Phrases("one two", "(own)", "three", "four")
    turn = UserTurn("item_1", 500.0, phrases, None, on_guess=told.append)  # type: ignore[arg-type]
    turn.feed(b"ab", 10)
    turn.end_phrase()
    phrases.made[0].release.set()
    turn.feed(b"cd", 10)
    turn.guess()
    guess = phrases.made[2]
    guess.release.set()
    await until(lambda: told)
    assert told == [turn] and turn.guessing
    # The ended phrase's words, then the guess's, before the pause ends its phrase.
    assert await turn.guessed_so_far() == "one two three"
    # A guess voided before its words come is never told.
    turn.unguess()
    turn.feed(b"ef", 10)
    turn.guess()
    turn.unguess()
    phrases.made[3].release.set()
    await asyncio.sleep(0)
    assert told == [turn] and not turn.guessing
