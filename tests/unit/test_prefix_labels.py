"""Which prefix key names each cut of a chat prompt, on a fake chat template's token ids:
every cut the prefill makes after a client message gets the key the head computes for
the messages up to it; turns the engine adds get none; prompts whose end-of-turn tokens
do not count one per message get no labels at all."""

from __future__ import annotations

from typing import Any

from omnistage.engines.llm.prefix_cache import MIN_LAST_CHUNK, cuts
from omnistage.engines.llm.prefix_labels import (
    rendered_turns,
    template_default_turns,
    turn_labels,
)
from omnistage.protocol.messages import ChatMessage
from omnistage.protocol.prefix import prefix_keys

START, END, NL = 1, 2, 3  # <|im_start|>, <|im_end|>, "\n"
ENDS = frozenset({END})
ROLES = {"system": 10, "user": 11, "assistant": 12, "tool": 13}
DEFAULT_SYSTEM = "You are a helpful assistant"


def _word_ids(text: str) -> list[int]:
    # One token per word; "<|im_end|>" typed in content is the special token itself,
    # as HF tokenizers parse it.
    return [END if w == "<|im_end|>" else 100 + len(w) for w in text.split()]


def render(messages: list[dict[str, Any]], default_system: bool = True) -> list[int]:
    """A ChatML template like SmolLM2's: a default system turn unless the messages
    start with one, each message one turn, then the assistant's header."""
    if default_system and (not messages or messages[0]["role"] != "system"):
        messages = [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]
    ids: list[int] = []
    for m in messages:
        ids += [START, ROLES[m["role"]], NL, *_word_ids(m["content"]), END, NL]
    return [*ids, START, ROLES["assistant"], NL]


def _dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [{"role": m.role, "content": m.content} for m in messages]


def _labels(
    client: list[ChatMessage], engine_system: str = "", default_system: bool = True
) -> tuple[list[int], dict[int, int]]:
    """The engine's path: its system prompt first, rendered, labelled."""
    rendered = _dicts(client)
    if engine_system and not any(m.role == "system" for m in client):
        rendered = [{"role": "system", "content": engine_system}, *rendered]
    default = template_default_turns(lambda m: render(m, default_system), ENDS)
    assert default == (1 if default_system else 0)
    ids = render(rendered, default_system)
    turns = rendered_turns(rendered, default)
    return ids, turn_labels(ids, ENDS, prefix_keys(client), turns - len(client))


LONG = " ".join(["word"] * (MIN_LAST_CHUNK + 2))
CHAT = [
    ChatMessage("user", "What is the capital of France?"),
    ChatMessage("assistant", "Paris is the capital of France."),
    ChatMessage("user", "And its most famous tower?"),
]


def test_each_cut_after_a_client_message_is_labelled_with_its_prefix_key() -> None:
    ids, labels = _labels(CHAT)
    keys = prefix_keys(CHAT)
    made = cuts(ids, ENDS)
    # After the default system turn and each message but the last (only the assistant's
    # header follows it: shorter than MIN_LAST_CHUNK).
    assert len(made) == 3
    assert labels[made[1]] == keys[0] and labels[made[2]] == keys[1]
    assert made[0] not in labels  # the template's system turn holds no client message
    # Every message's turn end is labelled, cut or not (only cuts are ever cached).
    assert sorted(labels.values()) == sorted(keys)
    assert all(ids[end - 1] == END for end in labels)


def test_a_client_system_message_is_the_first_key_and_the_template_adds_nothing() -> None:
    client = [ChatMessage("system", "Be brief."), *CHAT]
    ids, labels = _labels(client, engine_system="You are a voice.")
    keys = prefix_keys(client)
    ends = [i + 1 for i, t in enumerate(ids) if t == END]
    assert labels == dict(zip(ends, keys, strict=True))


def test_the_stage_system_prompt_comes_first_and_holds_no_key() -> None:
    ids, labels = _labels(CHAT, engine_system="You are a voice.", default_system=True)
    ends = [i + 1 for i, t in enumerate(ids) if t == END]
    assert len(ends) == 4  # the stage's system turn replaced the template's
    assert labels == dict(zip(ends[1:], prefix_keys(CHAT), strict=True))


def test_a_template_without_a_default_turn() -> None:
    ids, labels = _labels(CHAT, default_system=False)
    ends = [i + 1 for i, t in enumerate(ids) if t == END]
    assert labels == dict(zip(ends, prefix_keys(CHAT), strict=True))


def test_a_single_turn_labels_only_what_its_cuts_can_hold() -> None:
    # A one-question prompt: only the system turn is cut (the question's end leaves a
    # tail shorter than MIN_LAST_CHUNK), and the system turn holds no client message,
    # so nothing cached from it is labelled.
    client = [ChatMessage("user", "Hi there")]
    ids, labels = _labels(client)
    made = cuts(ids, ENDS)
    assert len(made) == 1 and made[0] not in labels
    assert list(labels.values()) == prefix_keys(client)


def test_an_end_of_turn_token_in_content_gets_no_labels() -> None:
    # A client typed the special token: one more end of turn than turns. Counting would
    # shift every key onto the wrong prefix, so nothing is labelled.
    client = [ChatMessage("user", f"{LONG} <|im_end|> {LONG}"), ChatMessage("user", LONG)]
    _, labels = _labels(client)
    assert labels == {}


def test_prompts_without_messages_or_turn_ends_get_no_labels() -> None:
    ids = render(_dicts(CHAT))
    assert turn_labels(ids, ENDS, [], 1) == {}
    assert turn_labels(ids, frozenset(), prefix_keys(CHAT), 1) == {}
    assert turn_labels(ids, ENDS, prefix_keys(CHAT), -1) == {}


def test_a_template_that_merges_turns_cannot_be_labelled() -> None:
    def merging(messages: list[dict[str, Any]]) -> list[int]:
        text = " ".join(m["content"] for m in messages)
        return [START, *_word_ids(text), END, START, ROLES["assistant"]]

    def refusing(messages: list[dict[str, Any]]) -> list[int]:
        raise ValueError("Conversation roles must alternate")

    assert template_default_turns(merging, ENDS) is None
    assert template_default_turns(refusing, ENDS) is None
    assert template_default_turns(render, frozenset()) is None  # no end-of-turn token


def test_rendered_turns_count_the_default_turn_unless_a_system_message_leads() -> None:
    assert rendered_turns([{"role": "user"}], 1) == 2
    assert rendered_turns([{"role": "system"}, {"role": "user"}], 1) == 2
    assert rendered_turns([{"role": "developer"}, {"role": "user"}], 1) == 3
    assert rendered_turns([{"role": "user"}], 0) == 1
