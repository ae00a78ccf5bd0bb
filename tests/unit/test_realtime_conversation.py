"""A Realtime conversation: items in order, client items checked, truncation to what
was heard, and the chat the thinker reads; ``response.create``'s settings over the
session's."""

from __future__ import annotations

from typing import Any

import pytest

from omnistage.audio.formats import PCM, PCMU
from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.messages import ChatMessage, ToolCall
from omnistage.realtime import conversation
from omnistage.realtime.config import SessionConfig
from omnistage.realtime.conversation import (
    Conversation,
    Item,
    Spoken,
    chat_messages,
    check_item,
    message_item,
)
from omnistage.realtime.replies import reply_settings


def user(text: str, item_id: str | None = None) -> Item:
    value: dict[str, Any] = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
    }
    if item_id is not None:
        value["id"] = item_id
    return check_item(value)


def ids(conv: Conversation) -> list[str]:
    return [item.id for item in conv]


def refused(call: Any, *args: Any) -> BadRequestError:
    with pytest.raises(BadRequestError) as info:
        call(*args)
    return info.value


# ------------------------------------------------------------------------ order


def test_items_go_last_after_an_item_or_first_at_root() -> None:
    conv = Conversation()
    assert conv.add(user("a", "a")) is None
    assert conv.add(user("b", "b")) == "a"
    assert conv.add(user("c", "c"), "root") is None
    assert conv.add(user("d", "d"), "a") == "a"
    assert ids(conv) == ["c", "a", "d", "b"]
    assert conv.last_id() == "b" and len(conv) == 4
    assert conv.previous_id(conv.get("d")) == "a" and conv.previous_id(conv.get("c")) is None


def test_an_unknown_previous_item_is_not_found() -> None:
    conv = Conversation()
    conv.add(user("a", "a"))
    err = refused(conv.add, user("b", "b"), "nope")
    assert (err.param, err.code) == ("previous_item_id", "item_not_found")
    assert ids(conv) == ["a"]


def test_an_id_is_used_once() -> None:
    conv = Conversation()
    conv.add(user("a", "a"))
    assert refused(conv.add, user("again", "a")).param == "item.id"


def test_a_full_conversation_forgets_its_oldest_item(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conversation, "MAX_ITEMS", 3)
    conv = Conversation()
    for name in "abc":
        conv.add(user(name, name))
    # A refused add changes nothing, full or not.
    assert refused(conv.add, user("x", "x"), "nope").code == "item_not_found"
    assert ids(conv) == ["a", "b", "c"]
    assert conv.add(user("d", "d")) == "c"
    assert ids(conv) == ["b", "c", "d"]
    assert conv.add(user("e", "e"), "c") == "c"
    assert ids(conv) == ["c", "e", "d"]
    assert conv.add(user("f", "f"), "root") is None
    assert ids(conv) == ["f", "e", "d"]


def test_delete_and_get_of_unknown_items() -> None:
    conv = Conversation()
    conv.add(user("a", "a"))
    conv.add(user("b", "b"))
    conv.delete("a")
    assert ids(conv) == ["b"]
    for call in (conv.delete, conv.get):
        err = refused(call, "a")
        assert (err.param, err.code) == ("item_id", "item_not_found")


# ------------------------------------------------------------------------ client items


def test_check_item_completes_what_the_client_left_out() -> None:
    item = check_item(
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    )
    assert item.id.startswith("item_") and item.type == "message"
    assert item.json["object"] == "realtime.item" and item.json["status"] == "completed"


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ([], "item"),
        ({"type": "reasoning"}, "item.type"),
        ({"type": "message", "id": "x" * 65, "role": "user"}, "item.id"),
        ({"type": "message", "role": "tool", "content": []}, "item.role"),
        ({"type": "message", "role": "user", "content": []}, "item.content"),
        (
            {"type": "message", "role": "user", "content": [{"type": "output_text", "text": "x"}]},
            "item.content[0].type",
        ),
        (
            {"type": "message", "role": "system", "content": [{"type": "input_audio"}]},
            "item.content[0].type",
        ),
        (
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "ok"}, {"type": "output_text"}],
            },
            "item.content[1].text",
        ),
        ({"type": "function_call", "call_id": "c", "name": "f"}, "item.arguments"),
        ({"type": "function_call_output", "output": "{}"}, "item.call_id"),
    ],
)
def test_check_item_names_the_bad_field(value: Any, param: str) -> None:
    assert refused(check_item, value).param == param


def test_a_user_audio_part_needs_no_text() -> None:
    item = check_item({"type": "message", "role": "user", "content": [{"type": "input_audio"}]})
    assert item.json["content"] == [{"type": "input_audio"}]


def test_check_item_names_fields_under_the_given_path() -> None:
    err = refused(check_item, {"type": "nope"}, "response.input[2]")
    assert err.param == "response.input[2].type"


# ------------------------------------------------------------------------ truncation


def test_last_said_is_the_assistants_words_when_its_message_is_last() -> None:
    conv = Conversation()
    assert conv.last_said() == ""
    conv.add(user("Book me a table."))
    assert conv.last_said() == ""  # the user spoke last: a new turn goes on, not replies
    said = [{"type": "output_audio", "transcript": "Sure. For how many people?"}]
    conv.add(message_item("assistant", said))
    assert conv.last_said() == "Sure. For how many people?"
    call = {"type": "function_call", "call_id": "c1", "name": "book", "arguments": "{}"}
    conv.add(check_item(call))  # a tool call after the answer: the answer is still what was said
    assert conv.last_said() == "Sure. For how many people?"
    conv.add(user("Four."))
    assert conv.last_said() == ""


def spoken_answer(*sentences: tuple[str, float]) -> Item:
    item = message_item("assistant", [{"type": "output_audio", "transcript": ""}])
    item.spoken = [Spoken(text, ms) for text, ms in sentences]
    return item


def test_truncate_keeps_the_sentences_heard_and_the_share_of_the_one_cut() -> None:
    item = spoken_answer(("One two three four.", 1000), ("Five six seven eight.", 1000))
    item.truncate(1500)
    assert item.json["content"][0]["transcript"] == "One two three four. Five six"
    assert item.json["status"] == "incomplete"
    assert item.audio_ms() == 1500


def test_truncate_at_a_sentence_end_keeps_it_whole() -> None:
    item = spoken_answer(("Hello there.", 800), ("More words here.", 800))
    item.truncate(800)
    assert item.json["content"][0]["transcript"] == "Hello there."


def test_truncate_at_zero_keeps_nothing() -> None:
    item = spoken_answer(("Hello there.", 800))
    item.truncate(0)
    assert item.json["content"][0]["transcript"] == ""
    assert chat_messages("", [item]) == []


def test_truncate_past_the_audio_is_refused() -> None:
    item = spoken_answer(("Hello.", 500))
    item.truncate(501)  # within a millisecond of the end: rounding, accepted
    assert refused(item.truncate, 600).param == "audio_end_ms"


# ------------------------------------------------------------------------ chat


def test_chat_messages_put_the_instructions_first_and_join_parts() -> None:
    answer = message_item("assistant", [{"type": "output_audio", "transcript": "Hi!"}])
    said = check_item(
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Look:"},
                {"type": "input_audio", "transcript": "what is this"},
            ],
        }
    )
    assert chat_messages("Be brief.", [said, answer]) == [
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Look: what is this"),
        ChatMessage("assistant", "Hi!"),
    ]
    assert chat_messages("", [answer]) == [ChatMessage("assistant", "Hi!")]


def test_chat_messages_skip_answers_with_no_words() -> None:
    silent = message_item("assistant", [{"type": "output_audio", "transcript": ""}])
    untranscribed = message_item("user", [{"type": "input_audio", "transcript": None}])
    assert chat_messages("x", [untranscribed, silent]) == [ChatMessage("system", "x")]


def test_function_calls_are_assistant_tool_calls_and_outputs_tool_messages() -> None:
    def call(call_id: str, name: str) -> Item:
        value = {"type": "function_call", "call_id": call_id, "name": name, "arguments": "{}"}
        return check_item(value)

    def output(call_id: str, text: str) -> Item:
        return check_item({"type": "function_call_output", "call_id": call_id, "output": text})

    items = [user("weather in Oslo and Rome?"), call("c1", "weather"), call("c2", "weather")]
    items += [output("c1", "rain"), output("c2", "sun"), call("c3", "time")]
    assert chat_messages("", items) == [
        ChatMessage("user", "weather in Oslo and Rome?"),
        # Parallel calls are one assistant turn.
        ChatMessage(
            "assistant",
            "",
            tool_calls=[ToolCall("c1", "weather", "{}"), ToolCall("c2", "weather", "{}")],
        ),
        ChatMessage("tool", "rain", tool_call_id="c1"),
        ChatMessage("tool", "sun", tool_call_id="c2"),
        ChatMessage("assistant", "", tool_calls=[ToolCall("c3", "time", "{}")]),
    ]


# ------------------------------------------------------------------------ replies


def session() -> SessionConfig:
    cfg = SessionConfig()
    cfg.update(
        {
            "tools": [{"type": "function", "name": "a"}],
            "temperature": 0.5,
            "max_output_tokens": 100,
            "audio": {"output": {"voice": "echo"}},
        }
    )
    return cfg


def test_an_empty_response_create_takes_the_session_settings() -> None:
    s = reply_settings(session(), {})
    assert s.modalities == ("audio",) and s.output_format == PCM and s.voice == "echo"
    assert s.tools == [{"type": "function", "name": "a"}] and s.tool_choice == "auto"
    assert s.max_output_tokens == 100 and s.temperature == 0.5
    assert s.in_conversation and s.metadata is None


def test_response_create_params_replace_the_session_settings_for_one_response() -> None:
    cfg = session()
    s = reply_settings(
        cfg,
        {
            "conversation": "none",
            "output_modalities": ["text"],
            "tools": [],
            "tool_choice": "none",
            "max_output_tokens": "inf",
            "temperature": 1,
            "metadata": {"topic": "x"},
            "audio": {"output": {"format": {"type": "audio/pcmu"}, "voice": "ash"}},
            "instructions": "Only this once.",
            "input": [],
        },
    )
    assert not s.in_conversation and s.modalities == ("text",)
    assert s.tools == [] and s.tool_choice == "none"
    assert s.max_output_tokens is None and s.temperature == 1.0
    assert s.metadata == {"topic": "x"}
    assert s.output_format == PCMU and s.voice == "ash"
    assert cfg.voice == "echo" and cfg.max_output_tokens == 100  # the session is unchanged


@pytest.mark.parametrize(
    ("params", "param", "code"),
    [
        ("x", "response", "invalid_value"),
        ({"modalities": ["text"]}, "response.modalities", "unknown_parameter"),
        ({"conversation": "conv_1"}, "response.conversation", "invalid_value"),
        ({"output_modalities": ["image"]}, "response.output_modalities", "invalid_value"),
        ({"tools": [{"type": "function"}]}, "response.tools[0].name", "invalid_value"),
        ({"tool_choice": "always"}, "response.tool_choice", "invalid_value"),
        ({"max_output_tokens": -1}, "response.max_output_tokens", "invalid_value"),
        ({"temperature": 9}, "response.temperature", "invalid_value"),
        ({"metadata": ["x"]}, "response.metadata", "invalid_value"),
        ({"instructions": 1}, "response.instructions", "invalid_value"),
        ({"audio": {"input": {}}}, "response.audio", "invalid_value"),
        (
            {"audio": {"output": {"format": {"type": "audio/ogg"}}}},
            "response.audio.output.format.type",
            "invalid_value",
        ),
        ({"audio": {"output": {"voice": 3}}}, "response.audio.output.voice", "invalid_value"),
        ({"audio": {"output": {"speed": 1}}}, "response.audio.output.speed", "unknown_parameter"),
    ],
)
def test_response_create_refusals_name_their_field(params: Any, param: str, code: str) -> None:
    err = refused(reply_settings, session(), params)
    assert (err.param, err.code) == (param, code)


def test_settings_become_stage_params() -> None:
    s = reply_settings(session(), {"tool_choice": {"type": "function", "name": "a"}})
    params = s.params(0, 1)
    text = params[0].text
    assert text is not None and text.max_tokens == 100 and text.temperature == 0.5
    assert text.tools == [{"type": "function", "function": {"name": "a"}}]
    assert text.tool_choice == {"type": "function", "function": {"name": "a"}}
    speech = params[1].speech
    assert speech is not None and speech.voice == "echo"
    # tool_choice "none" sends no tools; no talker, no speech params.
    none = reply_settings(session(), {"tool_choice": "none"}).params(0, None)
    assert set(none) == {0} and none[0].text is not None and not none[0].text.tools
