"""Which prefix key (``protocol/prefix``) names each cacheable prefix of a chat prompt.

The prefix cache keeps the KV of token prefixes that end after an end-of-turn token
(``prefix_cache.cuts``); the head, which has no tokenizer, names prefixes by the chat
messages they hold. A chat template renders each message as one turn that ends with an
end-of-turn token, after any turns the engine puts before the client's messages (the
stage's ``system_prompt``, the tools' instructions, a template's default system turn).
So the prefix that ends after the j-th end-of-turn token of a prompt holds the first
``j - leading`` client messages, and takes their key.

That is checked, not assumed: the prompt must hold exactly one end-of-turn token per
rendered turn. Content that holds one (a client may type a special token), or a
template that merges or drops turns, gets no labels at all: a wrong key would send the
conversation's next turns to a replica that does not hold their prefix. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Render = Callable[[list[dict[str, Any]]], Sequence[int]]


def turn_labels(
    ids: Sequence[int], turn_ends: frozenset[int], keys: Sequence[int], leading: int
) -> dict[int, int]:
    """Prefix end (a position as ``cuts`` gives them) -> the key of the messages it
    holds, for a prompt ``ids`` rendering ``leading`` turns of the engine's and then one
    turn per client message (whose keys are ``keys``); {} when the end-of-turn tokens
    do not count out that way."""
    ends = [i + 1 for i, token in enumerate(ids) if token in turn_ends]
    if not keys or leading < 0 or len(ends) != leading + len(keys):
        return {}
    return dict(zip(ends[leading:], keys, strict=True))


def template_default_turns(render: Render, turn_ends: frozenset[int]) -> int | None:
    """How many turns a chat template adds of its own before messages that do not start
    with a system message (SmolLM2's and Qwen's add a default system turn: 1); None if
    the template does not render one turn per message, so prompts cannot be labelled.
    ``render``: the messages -> the template's token ids (with the generation prompt)."""
    try:
        alone = _count(render([{"role": "user", "content": "Hi."}]), turn_ends)
        with_system = _count(
            render(
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
            ),
            turn_ends,
        )
    except Exception:  # a template that refuses these messages: no labels, still serving
        return None
    if with_system != 2 or alone not in (1, 2):
        return None
    return alone - 1


def _count(ids: Sequence[int], turn_ends: frozenset[int]) -> int:
    return sum(1 for token in ids if token in turn_ends)


def rendered_turns(rendered: Sequence[dict[str, Any]], default_turns: int) -> int:
    """The turns a template renders for ``rendered`` messages, its default turn too."""
    starts_with_system = bool(rendered) and rendered[0].get("role") == "system"
    return len(rendered) + (0 if starts_with_system else default_turns)
