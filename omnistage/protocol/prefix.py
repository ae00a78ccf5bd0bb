"""Prefix keys: what a chat prompt's cacheable prefixes are called, on both sides.

An llm engine's prefix cache keeps the KV of prompt prefixes that end at an end of turn
(see ``engines/llm/prefix_cache``), so a cacheable prefix is always "the first k
messages". The head has no tokenizer (the tokenizer runs in the replica), but it has the
messages: key k is a hash chained over messages 1..k (role, content, tool calls), so the
head computes the keys of a request from its messages, an engine labels each prefix it
caches with the key of the messages it ends after, and the two agree without either
sharing the other's tokens. A replica reports the keys its cache holds (in heartbeats,
bounded by ``MAX_REPORTED``); the head routes a request to where its longest prefix is.

Keys are 63-bit ints (msgpack-friendly), from BLAKE2b: the same on every machine and
Python (no ``hash()`` salt).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from omnistage.protocol.messages import ChatMessage

MAX_REPORTED = 512  # keys one replica reports at most (its most recently used)
_MASK = (1 << 63) - 1


def prefix_keys(messages: Sequence[ChatMessage]) -> list[int]:
    """Key k (0-based) names the prefix made of ``messages[: k + 1]``."""
    keys: list[int] = []
    state = b""
    for m in messages:
        h = hashlib.blake2b(state, digest_size=8)
        h.update(m.role.encode())
        h.update(b"\x00")
        h.update(m.content.encode())
        for call in m.tool_calls or ():
            h.update(b"\x01" + call.id.encode() + b"\x00" + call.name.encode())
            h.update(b"\x00" + call.arguments.encode())
        if m.tool_call_id:
            h.update(b"\x02" + m.tool_call_id.encode())
        state = h.digest()
        keys.append(int.from_bytes(state, "big") & _MASK)
    return keys


def prefix_weights(messages: Sequence[ChatMessage]) -> list[int]:
    """The size of each keyed prefix in characters (the head's stand-in for tokens):
    a request's cached share is the weight of its longest cached prefix over its whole."""
    total, out = 0, []
    for m in messages:
        total += len(m.content) + len(m.role) + 4
        for call in m.tool_calls or ():
            total += len(call.name) + len(call.arguments)
        out.append(total)
    return out
