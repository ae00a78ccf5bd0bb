"""A Realtime session's conversation: its items in order, and what the thinker reads.

Items keep OpenAI's JSON shape (``id``, ``type``, ``role``, ``content`` parts) so the
events that carry them need no conversion. What the thinker sees is derived from them
(``chat_messages``): the session's instructions, then each message's words; an
assistant answer that was cut off (barge-in, ``conversation.item.truncate``) reads as
only what was said, because its spoken sentences are kept with their audio lengths and
a truncation drops what the user never heard.
"""

from __future__ import annotations

import enum
import itertools
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.messages import ChatMessage, Prompt, ToolCall
from omnistage.realtime.input_buffer import RATE
from omnistage.realtime.options import bad

MAX_ITEMS = 1024
MAX_TEXT = 256 * 1024
_USER_PARTS = ("input_text", "input_audio")
_ASSISTANT_PARTS = ("output_text", "output_audio", "text")


class ItemStatus(enum.StrEnum):
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"  # cut short (barge-in, truncation, a failed answer)
    IN_PROGRESS = "in_progress"


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


@dataclass
class Spoken:
    """One sentence of an answer's audio, with how long it plays."""

    text: str
    audio_ms: float


@dataclass
class Item:
    """One conversation item: its JSON (as events carry it) and, for an assistant's
    audio, the sentences spoken so far."""

    json: dict[str, Any]
    spoken: list[Spoken] = field(default_factory=list)
    # A user turn's audio (24 kHz pcm16), where the thinker hears it itself.
    audio: bytes | None = None
    # An answer the server cut where its audio stopped going out (a barge-in over held
    # audio): it already ends where the user stopped hearing it.
    cut: bool = False
    # Where a client's truncate said the user stopped hearing it: Pipecat truncates at
    # ``speech_started``, while the server still holds the answer, before it cuts it.
    heard_ms: float | None = None

    @property
    def id(self) -> str:
        return self.json["id"]  # type: ignore[no-any-return]

    @property
    def type(self) -> str:
        return self.json["type"]  # type: ignore[no-any-return]

    def audio_ms(self) -> float:
        return sum(s.audio_ms for s in self.spoken)

    def truncate(self, audio_end_ms: int, *, cut: bool = False) -> int:
        """Keep the words of the first ``audio_end_ms`` of this answer's audio; the
        ``audio_end_ms`` applied. Past the item's audio is an error, as OpenAI's, except
        on an answer the server has ``cut``: a client that counts what it played by the
        clock (Pipecat) counts the time the audio was held too, and there is nothing
        more to cut. The server's own ``cut`` (what went out) keeps a client's shorter
        truncate before it, and is never an error."""
        total = self.audio_ms()
        if cut:
            heard = min(audio_end_ms, total, self.heard_ms if self.heard_ms is not None else total)
            audio_end_ms = int(heard)
        elif audio_end_ms > total + 1:
            if not self.cut:
                raise bad(
                    "audio_end_ms",
                    f"audio_end_ms {audio_end_ms} is past the item's audio ({total:.0f} ms)",
                )
            audio_end_ms = int(total)
        else:
            self.heard_ms = audio_end_ms
        self.cut = self.cut or cut
        kept: list[Spoken] = []
        at = 0.0
        for s in self.spoken:
            if at + s.audio_ms <= audio_end_ms:
                kept.append(s)
            elif at < audio_end_ms:
                # The sentence was cut inside: keep the share of its words heard.
                words = s.text.split()
                share = int(len(words) * (audio_end_ms - at) / s.audio_ms)
                kept.append(Spoken(" ".join(words[:share]), audio_end_ms - at))
            at += s.audio_ms
        self.spoken = kept
        part = self.json["content"][0]
        part["transcript"] = " ".join(s.text for s in kept if s.text)
        self.json["status"] = ItemStatus.INCOMPLETE
        return audio_end_ms

    def regrow(self, spoken: list[Spoken]) -> None:
        """An answer truncated while it was being made goes on from the cut: it holds all
        of the answer again (``spoken``: every sentence made), as its audio goes out."""
        self.spoken, self.heard_ms = list(spoken), None
        self.json["status"] = ItemStatus.IN_PROGRESS


def message_item(
    role: str, parts: list[dict[str, Any]], status: ItemStatus = ItemStatus.COMPLETED
) -> Item:
    return Item(
        {
            "id": new_id("item"),
            "object": "realtime.item",
            "type": "message",
            "status": status,
            "role": role,
            "content": parts,
        }
    )


def function_call_item(name: str) -> Item:
    """An answer's call of the function ``name``, its arguments still to come."""
    return Item(
        {
            "id": new_id("item"),
            "object": "realtime.item",
            "type": "function_call",
            "status": ItemStatus.IN_PROGRESS,
            "call_id": new_id("call"),
            "name": name,
            "arguments": "",
        }
    )


def check_item(value: Any, where: str = "item") -> Item:
    """A client's ``conversation.item.create`` item, checked and completed."""
    if not isinstance(value, Mapping):
        raise bad(where, "expected an object")
    kind = value.get("type")
    item = dict(value)
    item.setdefault("id", new_id("item"))
    item["object"] = "realtime.item"
    item.setdefault("status", ItemStatus.COMPLETED)
    if not isinstance(item["id"], str) or not 0 < len(item["id"]) <= 64:
        raise bad(f"{where}.id", "expected a string of at most 64 characters")
    if kind == "message":
        _check_message(item, where)
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise bad(f"{where}.{key}", "expected a string")
    elif kind == "function_call_output":
        for key in ("call_id", "output"):
            if not isinstance(item.get(key), str) or len(item[key]) > MAX_TEXT:
                raise bad(f"{where}.{key}", "expected a string")
    else:
        raise bad(
            f"{where}.type",
            f"expected 'message', 'function_call' or 'function_call_output', got {kind!r}",
        )
    return Item(item)


def _check_message(item: dict[str, Any], where: str) -> None:
    role = item.get("role")
    allowed = {"user": _USER_PARTS, "system": ("input_text",), "assistant": _ASSISTANT_PARTS}
    if role not in allowed:
        raise bad(f"{where}.role", f"expected 'user', 'assistant' or 'system', got {role!r}")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise bad(f"{where}.content", "expected a non-empty list of content parts")
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") not in allowed[role]:
            kinds = ", ".join(allowed[role])
            raise bad(f"{where}.content[{i}].type", f"a {role} message takes {kinds}")
        words = part.get("text", part.get("transcript"))
        if part["type"] != "input_audio" and not isinstance(words, str):
            raise bad(f"{where}.content[{i}].text", "expected a string")
        if isinstance(words, str) and len(words) > MAX_TEXT:
            raise bad(f"{where}.content[{i}].text", f"longer than {MAX_TEXT} characters")
        parts.append(dict(part))
    item["content"] = parts


def words_of(item: Item) -> str:
    """A message's words: its text parts and the transcripts of its audio."""
    out = []
    for part in item.json.get("content", []):
        words = part.get("text") or part.get("transcript")
        if isinstance(words, str) and words:
            out.append(words)
    return " ".join(out)


class Conversation:
    """The session's items in order (insertion after ``previous_item_id``, or last)."""

    def __init__(self) -> None:
        self._items: list[Item] = []
        self._ids = itertools.count()

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def last_id(self) -> str | None:
        return self._items[-1].id if self._items else None

    def get(self, item_id: str, param: str = "item_id") -> Item:
        for item in self._items:
            if item.id == item_id:
                return item
        raise BadRequestError(
            f"Item with item_id not found: {item_id}", param=param, code="item_not_found"
        )

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Insert ``item``; returns the id of the item before it (None: first)."""
        if any(i.id == item.id for i in self._items):
            raise bad("item.id", f"an item with id {item.id!r} already exists")
        # Where it goes is checked before anything changes: a refused add changes nothing.
        if previous_item_id is None:
            at = len(self._items)
        elif previous_item_id == "root":
            at = 0
        else:
            at = self._items.index(self.get(previous_item_id, "previous_item_id")) + 1
        if len(self._items) >= MAX_ITEMS:
            # Forget the oldest turn rather than refuse to go on (OpenAI truncates too).
            self._items.pop(0)
            at = max(0, at - 1)
        self._items.insert(at, item)
        return self._items[at - 1].id if at else None

    def delete(self, item_id: str) -> None:
        self._items.remove(self.get(item_id))

    def last_said(self) -> str:
        """What the assistant said last, if the conversation's last message is its: the
        words a new user turn replies to ("" otherwise)."""
        for item in reversed(self._items):
            if item.type == "message":
                return words_of(item) if item.json["role"] == "assistant" else ""
        return ""

    def previous_id(self, item: Item) -> str | None:
        at = self._items.index(item)
        return self._items[at - 1].id if at else None


def chat_prompt(instructions: str, items: list[Item], hears: bool) -> Prompt:
    """The thinker's prompt: the chat turns, and for a thinker that ``hears``, the last
    user turn's audio where it is one (a prompt holds one spoken input: an earlier turn
    is read by its transcript, if it has one)."""
    users = [i for i in items if i.type == "message" and i.json["role"] == "user"]
    spoken = users[-1] if hears and users and users[-1].audio is not None else None
    messages = chat_messages(instructions, items, spoken)
    if spoken is None:
        return Prompt(messages=messages)
    return Prompt(messages=messages, audio=spoken.audio, audio_format="pcm16", sample_rate=RATE)


def chat_messages(
    instructions: str, items: list[Item], spoken: Item | None = None
) -> list[ChatMessage]:
    """What the thinker reads: the instructions, then the items as chat turns (the
    ``spoken`` turn, whose audio the thinker hears, with or without words)."""
    out = [ChatMessage("system", instructions)] if instructions else []
    for item in items:
        js = item.json
        if js["type"] == "message":
            words = words_of(item)
            if words or item is spoken:  # an answer cut off before a word was said is no turn
                out.append(ChatMessage(js["role"], words))
        elif js["type"] == "function_call":
            call = ToolCall(js["call_id"], js["name"], js["arguments"])
            if out and out[-1].role == "assistant" and out[-1].tool_calls:
                out[-1].tool_calls.append(call)  # parallel calls: one assistant turn
            else:
                out.append(ChatMessage("assistant", "", tool_calls=[call]))
        elif js["type"] == "function_call_output":
            out.append(ChatMessage("tool", js["output"], tool_call_id=js["call_id"]))
    return out
