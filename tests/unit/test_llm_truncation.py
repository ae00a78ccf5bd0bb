"""Truncation "auto": which messages a conversation too long for its window keeps, and
that the cut stays put as the conversation grows (engines/llm/truncation.py)."""

from __future__ import annotations

import itertools

from omnistage.engines.llm.truncation import BLOCKS, cuts, size, truncate, truncate_prompt
from omnistage.protocol.messages import ChatMessage, Prompt, ToolCall

WINDOW = 400


def conversation(exchanges: int, system: bool = True) -> list[ChatMessage]:
    """A system message, then ``exchanges`` user/assistant pairs of ~20 tokens each."""
    out = [ChatMessage("system", "You are a helpful voice assistant.")] if system else []
    for i in range(exchanges):
        out.append(ChatMessage("user", f"Question number {i}: what is the weather like?"))
        out.append(ChatMessage("assistant", f"Answer {i}: it is sunny and warm today."))
    return out


def tokens(messages: list[ChatMessage]) -> int:
    """A stand-in for the tokenizer: each message's size, plus a few template tokens."""
    return sum(size(m) + 4 for m in messages)


def fits_in(window: int):
    return lambda messages: tokens(messages) <= window


def test_a_conversation_that_fits_is_kept_whole() -> None:
    messages = conversation(3)
    kept, dropped = truncate(messages, fits_in(WINDOW), WINDOW)
    assert kept == messages and dropped == 0


def test_the_oldest_whole_exchanges_go_and_the_system_message_stays() -> None:
    messages = conversation(40)
    assert tokens(messages) > WINDOW
    kept, dropped = truncate(messages, fits_in(WINDOW), WINDOW)
    assert tokens(kept) <= WINDOW
    assert kept[0] == messages[0]  # the system message
    assert kept[1].role == "user"  # an exchange starts the rest
    assert kept == [messages[0], *messages[1 + dropped :]]  # the newest, in order
    assert kept[-1] == messages[-1]
    # The first cut that fits: the one before it (fewer dropped) would not have.
    options = cuts(messages, WINDOW // BLOCKS)
    at = options.index(1 + dropped)
    assert at > 0 and tokens([messages[0], *messages[options[at - 1] :]]) > WINDOW


def test_the_cut_stays_put_while_the_conversation_grows_by_an_exchange() -> None:
    # Each turn adds an exchange; the cut (what the prompt starts with after the system
    # message) moves only now and then, by a block, so the prefix cache keeps serving.
    starts = []
    for exchanges in range(25, 60):
        kept, _ = truncate(conversation(exchanges), fits_in(WINDOW), WINDOW)
        starts.append(kept[1].content)
    moves = sum(a != b for a, b in itertools.pairwise(starts))
    assert 0 < moves <= len(starts) // 3, starts


def test_cuts_depend_only_on_what_came_before_them() -> None:
    block = WINDOW // BLOCKS
    short, long = cuts(conversation(30), block), cuts(conversation(50), block)
    assert short[:-1] == long[: len(short) - 1]  # the last is the least a request keeps
    assert all(conversation(50)[c].role == "user" for c in long)


def test_a_tool_result_never_outlives_its_call() -> None:
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    messages = conversation(20)
    messages += [
        ChatMessage("user", "And in Paris?"),
        ChatMessage("assistant", "", tool_calls=[call]),
        ChatMessage("tool", '{"sky": "clear"}', tool_call_id="call_1"),
    ]
    for window in range(60, 400, 7):
        kept, _ = truncate(messages, fits_in(window), window)
        called = {c.id for m in kept for c in m.tool_calls or ()}
        assert all(m.tool_call_id in called for m in kept if m.role == "tool"), window


def test_when_nothing_fits_the_least_is_kept_for_the_caller_to_refuse() -> None:
    messages = conversation(10)
    kept, dropped = truncate(messages, fits_in(10), 10)
    assert kept == [messages[0], *messages[-2:]] and dropped == len(messages) - 3
    # One user message alone: nothing can go.
    alone = [ChatMessage("user", "word " * 500)]
    assert truncate(alone, fits_in(10), 10) == (alone, 0)


def test_a_prompt_keeps_room_for_the_answer_within_a_quarter_window() -> None:
    prompt = Prompt(messages=conversation(40, system=False))

    def count(p: Prompt) -> int:
        return tokens(list(p.messages or ()))

    small, _ = truncate_prompt(prompt, count, WINDOW, answer=20)
    assert count(small) + 20 <= WINDOW
    large, dropped = truncate_prompt(prompt, count, WINDOW, answer=10_000)
    assert count(large) + WINDOW // BLOCKS <= WINDOW and dropped > 0
    assert count(large) <= count(small)
    text = Prompt(text="word " * 1000)  # a raw completion has no turns to drop
    assert truncate_prompt(text, lambda p: 5000, WINDOW, 20) == (text, 0)
