"""What the LLM engines (``llm``, ``vllm``) do to a prompt before tokenizing it: the
upstream stage's text merged in, the stage's system prompt put first, and the token ids
out of a chat template. Free of torch, so any engine may use it."""

from __future__ import annotations

from typing import Any

import msgspec

from omnistage.protocol.messages import ChatMessage, Prompt


def with_heard(prompt: Prompt | None, heard: str) -> Prompt:
    """The prompt with the upstream text in it: alone, it is the user turn; with the
    client's messages (speech in: the listener transcribed the last user turn's audio),
    it completes the last user message."""
    if prompt is None:
        return Prompt(messages=[ChatMessage("user", heard)])
    if not heard.strip():
        return prompt
    if prompt.messages is None:
        text = f"{prompt.text}\n{heard.strip()}" if prompt.text else heard.strip()
        return Prompt(text=text)
    messages = list(prompt.messages)
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role == "user":
            m = messages[i]
            content = f"{m.content}\n{heard.strip()}" if m.content.strip() else heard.strip()
            messages[i] = ChatMessage(m.role, content, m.tool_calls, m.tool_call_id)
            return Prompt(messages=messages)
    return Prompt(messages=[*messages, ChatMessage("user", heard.strip())])


def with_system(prompt: Prompt, system: str) -> Prompt:
    """The stage's system prompt first, unless the client sent a system message (a
    plain text prompt is a raw completion and has no turns to put it in)."""
    messages = prompt.messages
    if messages is None or any(m.role in ("system", "developer") for m in messages):
        return prompt
    return msgspec.structs.replace(prompt, messages=[ChatMessage("system", system), *messages])


def token_ids(out: Any) -> list[int]:
    """apply_chat_template returns a list or a BatchEncoding depending on the version."""
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(i) for i in out]
