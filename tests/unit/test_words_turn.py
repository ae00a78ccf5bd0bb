"""The words' end-of-turn verdict (``realtime.words_turn``): what the thinker is asked and
how its answer is read, over a scripted pipeline."""

from __future__ import annotations

import math

import msgspec

from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import ChatMessage, TokenLogprob, TopLogprob
from omnistage.realtime.words_turn import (
    SAID_CHARS,
    TOP,
    WordsJudge,
    end_probability,
    normalized,
    said_tail,
)
from tests.unit.fakes import FakeService, ScriptedStream, chunk

THINKER = 3


def _entry(**probabilities: float) -> TokenLogprob:
    tops = [TopLogprob(t, math.log(p), None) for t, p in probabilities.items()]
    return TokenLogprob(tops[0].token, tops[0].logprob, None, tops)


def test_words_are_asked_without_punctuation_in_lowercase() -> None:
    assert normalized(" What's the capital of  France?") == "what's the capital of france"
    assert normalized("Wait... um, I—think") == "wait um i think"
    assert normalized("?!.") == ""


def test_the_end_probability_sums_the_sentence_ending_marks() -> None:
    entry = _entry(**{" is": 0.5, "?": 0.2, ".": 0.1, " !": 0.05, '?"': 0.05})
    assert end_probability(entry) == 0.2 + 0.1 + 0.05  # '?"' is not an end mark alone


async def test_the_thinker_is_asked_the_open_words_for_one_tokens_alternatives() -> None:
    asked: list[PipelineRequest] = []

    async def opener(request: PipelineRequest) -> ScriptedStream:
        asked.append(request)
        stream = ScriptedStream(request.request_id)
        out = chunk(THINKER, text="?", finished=True)
        stream.put(msgspec.structs.replace(out, logprobs=[_entry(**{"?": 0.6, " in": 0.3})]))
        stream.end()
        return stream

    judge = WordsJudge(FakeService(opener=opener), THINKER)  # type: ignore[arg-type]
    assert await judge("What is the capital of France?") == 0.6
    (request,) = asked
    assert request.only and request.finals == [THINKER]
    assert request.prompt.messages == [ChatMessage("user", "what is the capital of france")]
    params = request.stage_params[THINKER].text
    assert params is not None and params.continue_final_message
    assert (params.max_tokens, params.temperature) == (1, 0.0)
    assert (params.logprobs, params.top_logprobs) == (True, TOP)
    assert await judge(" ... ") is None and len(asked) == 1  # no words: nothing asked
    # A reply to a question: the question comes before the open words.
    assert await judge("Yes please", "Sure. Shall I book it? ") == 0.6
    assert asked[-1].prompt.messages == [
        ChatMessage("assistant", "Sure. Shall I book it?"),
        ChatMessage("user", "yes please"),
    ]
    # After a statement the words are a new turn, read alone.
    assert await judge("How far is it?", "The capital of France is Paris.") == 0.6
    assert asked[-1].prompt.messages == [ChatMessage("user", "how far is it")]


def test_only_the_end_of_a_long_answer_is_shown() -> None:
    assert said_tail("  Shall I\n book it? ") == "Shall I book it?"
    long = " ".join(f"word{i}" for i in range(200)) + " Shall I book it?"
    tail = said_tail(long)
    assert tail.endswith("Shall I book it?") and len(tail) <= SAID_CHARS
    assert long.endswith(" " + tail)  # cut at a word boundary, not inside one


async def test_a_thinker_that_refuses_is_not_asked_again_and_a_failure_gives_no_verdict() -> None:
    calls: list[str] = []

    async def refusing(request: PipelineRequest) -> ScriptedStream:
        calls.append(request.request_id)
        raise BadRequestError("continue_final_message is not supported", "messages")

    judge = WordsJudge(FakeService(opener=refusing), THINKER)  # type: ignore[arg-type]
    assert await judge("hello there") is None
    assert await judge("hello again") is None
    assert len(calls) == 1

    async def failing(request: PipelineRequest) -> ScriptedStream:
        calls.append(request.request_id)
        raise RuntimeError("the stage failed")

    judge = WordsJudge(FakeService(opener=failing), THINKER)  # type: ignore[arg-type]
    assert await judge("hello there") is None
    assert await judge("hello again") is None
    assert len(calls) == 3  # a failure is this turn's: the next one asks again
