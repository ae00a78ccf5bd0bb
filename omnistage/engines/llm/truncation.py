"""Truncation "auto": a conversation too long for the context window loses its oldest
exchanges, not the request.

OpenAI's Realtime sessions (``truncation: "auto"``, their default) and its Responses API
(when asked) drop the oldest messages of a conversation that no longer fits the model's
window, so a long spoken conversation goes on where a plain request would be refused. The
engine does it, not the head: it has the tokenizer and the window, so it counts the
prompt as the model reads it.

What is kept: the leading system and developer messages, and whole exchanges from the
newest back (an exchange starts at a user message and holds the answers, tool calls and
tool results after it), so a template that wants a user turn first gets one and no tool
result outlives its call.

Where it cuts is stable as the conversation grows. The exchanges are grouped into blocks
of about ``window / BLOCKS`` tokens by where they start (which depends only on what came
before them), and the cut is always at a block's first exchange: one request after
another cuts at the same place until the next block has to go. The prompt's head then
stays the same from one turn to the next, and the engine's prefix cache keeps serving
it; cutting one exchange at a time would change the head every turn and re-read the
whole conversation each time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import msgspec

from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.messages import ChatMessage, Prompt

log = logging.getLogger(__name__)

BLOCKS = 4  # blocks per window: the cut moves by about a quarter window at a time
CHARS_PER_TOKEN = 4  # for grouping only: the fit is counted with the tokenizer
LEADING = ("system", "developer")


def context_length_error(window: int, tokens: int) -> BadRequestError:
    # OpenAI's wording: LiteLLM and others classify the error by it.
    return BadRequestError(
        f"This model's maximum context length is {window} tokens. "
        f"However, your messages resulted in {tokens} tokens. Please reduce the "
        "length of the messages.",
        "messages",
        "context_length_exceeded",
    )


def size(message: ChatMessage) -> int:
    """About how many tokens ``message`` takes (its characters over ``CHARS_PER_TOKEN``)."""
    chars = len(message.content) + len(message.role)
    for call in message.tool_calls or ():
        chars += len(call.name) + len(call.arguments)
    return chars // CHARS_PER_TOKEN + 1


def leading(messages: Sequence[ChatMessage]) -> int:
    """How many system and developer messages lead ``messages`` (always kept)."""
    lead = 0
    while lead < len(messages) and messages[lead].role in LEADING:
        lead += 1
    return lead


def cuts(messages: Sequence[ChatMessage], block: int) -> list[int]:
    """The indices a truncation may keep ``messages`` from, in order: the first exchange of
    each block after the first, and the last exchange (the least a request can keep)."""
    lead = leading(messages)
    starts = [i for i in range(lead + 1, len(messages)) if messages[i].role == "user"]
    out: list[int] = []
    position, seen, last_block = 0, lead, 0
    for start in starts:
        position += sum(size(m) for m in messages[seen:start])
        seen = start
        if position // block > last_block:
            last_block = position // block
            out.append(start)
    if starts and (not out or out[-1] != starts[-1]):
        out.append(starts[-1])
    return out


def truncate(
    messages: Sequence[ChatMessage],
    fits: Callable[[list[ChatMessage]], bool],
    window: int,
) -> tuple[list[ChatMessage], int]:
    """``messages`` cut at the first of their ``cuts`` that ``fits``, and how many messages
    were dropped (0: they fit whole). If none fits, the least that can be kept: the
    caller refuses it as too long."""
    whole = list(messages)
    if fits(whole):
        return whole, 0
    lead = leading(whole)
    options = cuts(whole, max(1, window // BLOCKS))
    if not options:
        return whole, 0

    def kept(cut: int) -> list[ChatMessage]:
        return whole[:lead] + whole[cut:]

    # Fewer messages never take more tokens: the first cut that fits, by bisection.
    lo, hi = 0, len(options) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(kept(options[mid])):
            hi = mid
        else:
            lo = mid + 1
    cut = options[lo]
    return kept(cut), cut - lead


def truncate_prompt(
    prompt: Prompt, tokens: Callable[[Prompt], int], window: int, answer: int
) -> tuple[Prompt, int]:
    """``prompt`` without the oldest exchanges that leave too little room in ``window`` for
    the answer, counted with ``tokens`` (the prompt's length as the model reads it); and
    how many messages went. ``answer``: the tokens the answer may take, of which a
    quarter of the window at most is kept free (a request for more than the window must
    still keep some conversation)."""
    if prompt.messages is None:
        return prompt, 0
    room = min(answer, window // BLOCKS)

    def fits(messages: list[ChatMessage]) -> bool:
        return tokens(msgspec.structs.replace(prompt, messages=messages)) + room <= window

    messages, dropped = truncate(prompt.messages, fits, window)
    if not dropped:
        return prompt, 0
    log.debug("truncation: the %d oldest messages dropped to fit the window", dropped)
    return msgspec.structs.replace(prompt, messages=messages), dropped
