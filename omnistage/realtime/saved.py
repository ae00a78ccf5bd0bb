"""A session as the store keeps it, so a client can resume it on another API process
or head (our extension; OpenAI's API has none): its config as the session object that
``session.updated`` reports, and its items as their JSON with an answer's spoken
sentences (what ``conversation.item.truncate`` cuts by). Pure: the API's saver writes
what ``snapshot`` gives whenever the session emits one of ``SAVED_EVENTS``.
"""

from __future__ import annotations

import copy
from typing import Any

from omnistage.realtime import events as ev
from omnistage.realtime.config import SessionConfig
from omnistage.realtime.conversation import Conversation, Item, ItemStatus, Spoken

# The events that report a change to the config or the conversation: each one saves.
SAVED_EVENTS = (
    ev.SessionUpdated,
    ev.ItemAdded,
    ev.ItemDone,
    ev.ItemDeleted,
    ev.ItemTruncated,
    ev.TranscriptionCompleted,
    ev.OutputItemDone,
    ev.ResponseDone,
)


def snapshot(
    session_json: dict[str, Any], config: SessionConfig, conversation: Conversation
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The config and items to save, copied: answers change their items in place while
    the store writes on its own thread."""
    saved_config = {**session_json, "temperature": config.temperature}
    items = []
    for item in conversation:
        row: dict[str, Any] = {"item": item.json}
        if item.spoken:
            row["spoken"] = [[s.text, s.audio_ms] for s in item.spoken]
        items.append(row)
    return copy.deepcopy(saved_config), copy.deepcopy(items)


def restore_config(config: SessionConfig, saved: dict[str, Any]) -> None:
    """Apply a saved session object (``session.update`` takes that shape back)."""
    config.update(saved)


def restore_items(conversation: Conversation, rows: list[dict[str, Any]]) -> None:
    """Fill an empty conversation with saved items, in order. An item still in progress
    was an answer cut short when its process died: it is kept as ``incomplete``, with
    what it had said by the last save (the client asks again for the rest)."""
    for row in rows:
        js = row["item"]
        if js.get("status") == ItemStatus.IN_PROGRESS:
            js["status"] = ItemStatus.INCOMPLETE
        spoken = [Spoken(text, ms) for text, ms in row.get("spoken", ())]
        conversation.add(Item(js, spoken))
