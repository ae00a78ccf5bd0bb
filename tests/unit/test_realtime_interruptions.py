"""Speech over an answer pauses its audio at once; a backchannel or a noise resumes it
where it paused, a request cancels it and is answered (the real session, over the
scripted pipeline and VAD of test_realtime_session)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest

from omnistage.audio.server_vad import SpeechStarted, SpeechStopped
from omnistage.realtime.backchannel import BackchannelPolicy, Decision, is_backchannel
from tests.unit.fakes import ScriptedStream, ticks, until
from tests.unit.test_realtime_session import LISTENER, Harness, speech, spoken_turn, words


@pytest.mark.parametrize(
    "text",
    ["uh-huh", "Mm-hmm.", "yeah", "Yes!", "okay", "OK, right.", "sure", "I see.", "", " ... "],
)
def test_acknowledgements_and_noise_are_backchannels(text: str) -> None:
    assert is_backchannel(text)


@pytest.mark.parametrize(
    "text", ["wait", "stop", "yeah but what about tomorrow", "okay okay okay okay okay", "no"]
)
def test_anything_else_is_a_request(text: str) -> None:
    assert not is_backchannel(text)


def test_the_policy_weighs_length_and_words() -> None:
    policy = BackchannelPolicy(max_speech_ms=1000)
    assert policy.speaking(900) == Decision.WAIT
    assert policy.speaking(1001) == Decision.CANCEL  # too long for a backchannel
    assert policy.heard(600, "Uh-huh.") == Decision.RESUME
    assert policy.heard(600, "") == Decision.RESUME  # a noise
    assert policy.heard(600, "wait") == Decision.CANCEL
    assert policy.heard(1200, "okay") == Decision.CANCEL
    assert policy.heard(600, None) == Decision.RESUME  # nobody transcribes: short speech


def audio_of(h: Harness) -> bytes:
    return b"".join(base64.b64decode(e["delta"]) for e in h.of("response.output_audio.delta"))


async def talking(h: Harness) -> ScriptedStream:
    """A turn answered; the answer has sent its first sentence's audio."""
    await spoken_turn(h)
    answer = await h.answered()
    answer.put(*words("One.", " Two.")[:2], speech("One."))
    await until(lambda: h.of("response.output_audio.delta"), what="the first audio")
    return answer


async def test_a_backchannel_pauses_the_answer_then_resumes_it_where_it_paused() -> None:
    h = Harness("tell me a story", "uh-huh")
    answer = await talking(h)
    before = len(h.of("response.output_audio.delta"))
    await h.append(100, SpeechStarted(420))
    answer.put(speech("Two."))  # made while the user speaks: held
    await ticks(20)
    assert len(h.of("response.output_audio.delta")) == before
    assert h.session.turns.interruptions.held is h.session.response
    h.vad.detector.silence_from = 500  # the user pauses: "uh-huh" is heard, and judged
    await h.append(200)
    await until(lambda: len(h.of("response.output_audio.delta")) > before, what="resumed")
    answer.put(*words("")[1:])
    answer.end()
    await h.append(300, SpeechStopped(500))
    await until(lambda: h.of("response.done"), what="response.done")
    (done,) = h.of("response.done")
    assert done["response"]["status"] == "completed" and h.stats.barge_ins == 0
    assert done["response"]["output"][0]["content"][0]["transcript"] == "One. Two."
    assert len(audio_of(h)) == 2 * 2205 * 2 * 24000 // 22050  # all of it, once
    await ticks(20)
    assert len(h.answers) == 1  # the backchannel is a turn of the conversation, unanswered
    assert [i.json["role"] for i in h.session.conversation] == ["user", "assistant", "user"]


async def test_a_request_over_an_answer_cancels_it_as_far_as_it_was_heard() -> None:
    h = Harness("tell me a story", "wait, what about tomorrow")
    answer = await talking(h)
    await h.append(100, SpeechStarted(420))
    answer.put(speech("Two."))
    await h.append(300, SpeechStopped(500))
    await until(lambda: answer.closed, what="the answer to be cancelled")
    started = h.kinds().index("input_audio_buffer.speech_started", 3)
    assert "response.output_audio.delta" not in h.kinds()[started:]
    done = h.of("response.done")[0]
    assert done["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    item = done["response"]["output"][0]
    assert item["content"][0]["transcript"] == "One."  # "Two." was made, never sent
    assert h.stats.barge_ins == 1
    second = await h.answered(2)  # the request is answered
    messages = h.requests[1].prompt.messages
    assert messages is not None and messages[-1].content == "wait, what about tomorrow"
    second.end()
    # A client that counts what it played by the clock (Pipecat) counts the held time
    # too: a truncate past what went out finds nothing more to cut.
    await h.send("conversation.item.truncate", item_id=item["id"], audio_end_ms=60_000)
    (truncated,) = h.of("conversation.item.truncated")
    assert truncated["audio_end_ms"] == 100 and not h.errors()  # "One." is 100 ms


async def test_a_truncate_at_speech_start_then_a_request_cancels_it_where_the_client_cut() -> None:
    """Pipecat truncates the answer at ``speech_started`` to what its clock says played,
    less than what went out; the request then cancels the answer, which keeps the
    client's cut (it was an error that left the response without its done events)."""
    h = Harness("tell me a story", "wait, what about tomorrow")
    answer = await talking(h)
    await h.append(100, SpeechStarted(420))
    item_id = h.of("response.output_audio.delta")[0]["item_id"]
    await h.send("conversation.item.truncate", item_id=item_id, audio_end_ms=40)
    (truncated,) = h.of("conversation.item.truncated")
    assert truncated["audio_end_ms"] == 40
    answer.put(speech("Two.", samples=441))  # 20 ms made while held: 60 ms now, 100 went out
    await h.append(300, SpeechStopped(500))
    await until(lambda: h.of("response.done"), what="response.done")
    done = h.of("response.done")[0]
    assert done["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    assert not h.errors()
    item = h.session.conversation.get(item_id)
    assert item.audio_ms() == 40 and item.cut  # not "Two.", made after the cut, never sent


async def test_speech_too_long_for_a_backchannel_cancels_before_its_words() -> None:
    h = Harness("tell me a story")
    answer = await talking(h)
    await h.append(100, SpeechStarted(420))
    await h.append(1000)
    assert not answer.closed
    await h.append(600)  # 1.7 s into the turn, still speaking
    await until(lambda: answer.closed, what="the answer to be cancelled")
    assert h.stats.barge_ins == 1


async def test_going_on_after_a_backchannel_holds_the_answer_again() -> None:
    h = Harness("tell me a story", "yeah", "but why")
    answer = await talking(h)
    await h.append(100, SpeechStarted(420))
    h.vad.detector.silence_from = 500
    await h.append(200)
    await until(lambda: h.session.turns.interruptions.held is None, what="resumed")
    h.vad.detector.silence_from = None  # "... but why"
    await h.append(100)
    assert h.session.turns.interruptions.held is h.session.response
    await h.append(100, SpeechStopped(800))
    await until(lambda: answer.closed, what="the answer to be cancelled")
    await h.answered(2)


async def test_where_nobody_transcribes_short_speech_resumes_the_answer() -> None:
    h = Harness(hears=True)  # an omni thinker hears the audio itself: no words to judge
    answer = await talking(h)
    await h.append(100, SpeechStarted(420))
    answer.put(speech("Two."))
    await ticks(20)
    assert len(h.of("response.output_audio.delta")) == 1
    h.vad.detector.silence_from = 500
    await h.append(200)  # paused after 280 ms of turn audio: a backchannel or a noise
    assert len(h.of("response.output_audio.delta")) == 2 and not answer.closed


async def test_a_cleared_input_buffer_resumes_a_held_answer() -> None:
    h = Harness("tell me a story")
    answer = await talking(h)
    await h.append(100, SpeechStarted(420))
    answer.put(speech("Two."))
    await ticks(20)
    await h.send("input_audio_buffer.clear")
    assert len(h.of("response.output_audio.delta")) == 2 and not answer.closed
    assert h.session.turns.interruptions.held is None


async def test_a_request_still_being_judged_when_the_user_speaks_again_still_cancels() -> None:
    h = Harness("tell me a story")
    answer = await talking(h)
    release = asyncio.Event()
    opener = h.session.ctx.service._opener  # type: ignore[attr-defined]

    async def slow_listener(request: Any) -> Any:  # the first request's words come late
        if request.finals == [LISTENER]:
            await release.wait()
        return await opener(request)

    h.session.ctx.service._opener = slow_listener  # type: ignore[attr-defined]
    h.transcripts += ["wait, what about tomorrow", "uh-huh"]
    await h.append(100, SpeechStarted(420))
    await h.append(100, SpeechStopped(560), SpeechStarted(600))  # judged, and again speech
    h.vad.detector.silence_from = 640
    await h.append(200)
    release.set()
    await until(lambda: answer.closed, what="the answer to be cancelled")
    await h.append(300, SpeechStopped(700))
    await h.answered(2)  # the request is answered (with the "uh-huh" after it)


# ------------------------------------------------------------- words that come late


def slow_words(h: Harness) -> asyncio.Event:
    """The listener's words come only once the returned event is set."""
    release = asyncio.Event()
    opener = h.session.ctx.service._opener  # type: ignore[attr-defined]

    async def slow_listener(request: Any) -> Any:
        if request.finals == [LISTENER]:
            await release.wait()
        return await opener(request)

    h.session.ctx.service._opener = slow_listener  # type: ignore[attr-defined]
    return release


QUICK = BackchannelPolicy(words_wait_ms=0)  # short speech's words are never awaited


async def test_short_speech_whose_words_are_slow_resumes_before_them_and_they_confirm() -> None:
    h = Harness("tell me a story", "uh-huh", policy=QUICK)
    answer = await talking(h)
    release = slow_words(h)
    await h.append(100, SpeechStarted(420))
    answer.put(speech("Two."))
    h.vad.detector.silence_from = 500  # paused after 280 ms: short enough
    await h.append(200)
    await until(lambda: len(h.of("response.output_audio.delta")) == 2, what="resumed unheard")
    assert h.session.turns.interruptions.held is None and not h.listened[1:]
    release.set()
    await h.append(300, SpeechStopped(500))
    users = lambda: [e for e in h.of("conversation.item.done") if e["item"]["role"] == "user"]  # noqa: E731
    await until(lambda: len(users()) == 2, what="its words")
    await ticks(20)
    answer.put(*words("")[1:])
    answer.end()
    await until(lambda: h.of("response.done"), what="response.done")
    assert h.of("response.done")[0]["response"]["status"] == "completed"
    assert h.stats.barge_ins == 0 and len(h.answers) == 1


async def test_short_speech_resumed_unheard_still_cancels_once_its_words_are_a_request() -> None:
    h = Harness("tell me a story", "stop", policy=QUICK)
    answer = await talking(h)
    release = slow_words(h)
    await h.append(100, SpeechStarted(420))
    h.vad.detector.silence_from = 500
    await h.append(200)
    await until(lambda: h.session.turns.interruptions.held is None, what="resumed unheard")
    await h.append(300, SpeechStopped(500))  # the turn ends before its words are heard
    assert not answer.closed
    release.set()
    await until(lambda: answer.closed, what="the answer to be cancelled")
    assert h.stats.barge_ins == 1
    second = await h.answered(2)  # and the request is answered
    messages = h.requests[1].prompt.messages
    assert messages is not None and messages[-1].content == "stop"
    second.end()


async def test_speech_too_long_to_be_quick_waits_for_its_words() -> None:
    h = Harness(
        "tell me a story", "uh-huh", policy=BackchannelPolicy(quick_ms=200, words_wait_ms=0)
    )
    answer = await talking(h)
    release = slow_words(h)
    await h.append(100, SpeechStarted(420))
    answer.put(speech("Two."))
    h.vad.detector.silence_from = 500
    await h.append(200)  # paused after 280 ms: longer than quick_ms
    await ticks(20)
    assert h.session.turns.interruptions.held is h.session.response
    assert len(h.of("response.output_audio.delta")) == 1
    release.set()
    await until(lambda: len(h.of("response.output_audio.delta")) == 2, what="resumed")


async def test_only_a_silence_longer_than_a_pause_between_words_resumes_unheard() -> None:
    h = Harness("tell me a story", "wait, stop", policy=BackchannelPolicy())
    answer = await talking(h)
    release = slow_words(h)
    await h.append(100, SpeechStarted(420))
    answer.put(speech("Two."))
    h.vad.detector.silence_from = 500
    await h.append(200)  # the pause after "wait,": short speech, its words not in
    await h.append(100)  # 100 ms more of silence (of the user's audio): a comma's pause
    await ticks(20)
    assert len(h.of("response.output_audio.delta")) == 1
    h.vad.detector.silence_from = None  # "... stop": the same request goes on
    await h.append(100)
    h.vad.detector.silence_from = 900
    await h.append(200)  # its second pause, and this time a silence as long as words_wait
    await h.append(int(BackchannelPolicy().words_wait_ms))
    await until(lambda: len(h.of("response.output_audio.delta")) == 2, what="resumed unheard")
    await h.append(100, SpeechStopped(900))
    release.set()  # the words: a request after all
    await until(lambda: answer.closed, what="the answer to be cancelled")
    await h.answered(2)


class Playback:
    """Where the server plays the answers (a WebRTC call's track), as the session sees it."""

    def __init__(self) -> None:
        self.sounding = True
        self.calls: list[str] = []

    def pause(self) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")

    def cut(self) -> None:
        self.calls.append("cut")
        self.sounding = False


async def played(h: Harness) -> Playback:
    """A turn answered, the answer all made (``response.done``) but still playing on the
    server's side."""
    answer = await talking(h)
    answer.put(speech("Two."), *words("")[1:])
    answer.end()
    await until(lambda: h.of("response.done"), what="response.done")
    playback = Playback()
    h.session.playback = playback
    return playback


async def test_a_backchannel_over_an_answer_still_playing_pauses_and_resumes_its_playback() -> None:
    h = Harness("tell me a story", "uh-huh")
    playback = await played(h)
    await h.append(100, SpeechStarted(420))
    assert playback.calls == ["pause"]  # before speech_started went out
    h.vad.detector.silence_from = 500
    await h.append(200)
    await until(lambda: playback.calls == ["pause", "resume"], what="resumed")
    await h.append(300, SpeechStopped(500))
    await ticks(20)
    assert len(h.answers) == 1 and h.stats.barge_ins == 0  # the "uh-huh" is not answered
    assert [i.json["role"] for i in h.session.conversation] == ["user", "assistant", "user"]


async def test_a_request_over_an_answer_still_playing_cuts_its_playback_and_is_answered() -> None:
    h = Harness("tell me a story", "wait, what about tomorrow")
    playback = await played(h)
    await h.append(100, SpeechStarted(420))
    await h.append(300, SpeechStopped(500))
    await until(lambda: "cut" in playback.calls, what="the playback cut")
    assert playback.calls == ["pause", "cut"] and h.stats.barge_ins == 1
    second = await h.answered(2)
    messages = h.requests[1].prompt.messages
    assert messages is not None and messages[-1].content == "wait, what about tomorrow"
    second.end()
    # Where nothing plays any more, speech is a turn like any other: no pause.
    h2 = Harness("tell me a story", "uh-huh")
    quiet = await played(h2)
    quiet.sounding = False
    await h2.append(100, SpeechStarted(420))
    assert quiet.calls == []
