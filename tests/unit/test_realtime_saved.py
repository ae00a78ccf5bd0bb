"""A session as the store keeps it (``realtime.saved``): what a resume restores."""

from __future__ import annotations

import msgspec

from omnistage.realtime import saved
from omnistage.realtime.config import SessionConfig
from omnistage.realtime.conversation import Conversation, Spoken, message_item


def _through_json(value: object) -> object:
    return msgspec.json.decode(msgspec.json.encode(value))


def test_config_and_items_come_back_as_they_were_saved() -> None:
    config = SessionConfig(model="m")
    config.update({"instructions": "Be brief.", "temperature": 0.3, "tool_choice": "none"})
    config.update({"audio": {"output": {"voice": "ash", "speed": 1.2}}})
    conversation = Conversation()
    user = message_item("user", [{"type": "input_text", "text": "hello"}])
    answer = message_item("assistant", [{"type": "output_audio", "transcript": "hi there"}])
    answer.spoken = [Spoken("hi", 400.0), Spoken("there", 600.0)]
    conversation.add(user)
    conversation.add(answer)
    saved_config, items = _through_json(
        saved.snapshot(config.to_json("s", 0), config, conversation)
    )

    back = SessionConfig(model="other")
    saved.restore_config(back, saved_config)
    assert back == config
    restored = Conversation()
    saved.restore_items(restored, items)
    assert [i.json for i in restored] == [user.json, answer.json]
    # An answer's sentences come back too: a truncation cuts them as before.
    again = restored.get(answer.id)
    again.truncate(500)
    assert again.json["content"][0]["transcript"] == "hi"


def test_an_answer_in_progress_when_its_process_died_comes_back_incomplete() -> None:
    conversation = Conversation()
    cut = message_item("assistant", [{"type": "output_text", "text": "half"}], "in_progress")
    conversation.add(cut)
    _, items = saved.snapshot({}, SessionConfig(), conversation)
    restored = Conversation()
    saved.restore_items(restored, items)
    (item,) = restored
    assert (item.json["status"], item.json["content"][0]["text"]) == ("incomplete", "half")


def test_the_snapshot_is_a_copy_an_answer_may_go_on_changing() -> None:
    conversation = Conversation()
    answer = message_item("assistant", [{"type": "output_text", "text": "a"}])
    conversation.add(answer)
    _, items = saved.snapshot({}, SessionConfig(), conversation)
    answer.json["content"][0]["text"] = "a b"
    assert items[0]["item"]["content"][0]["text"] == "a"
