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


def chat_ids(
    tokenizer: Any, messages: list[dict[str, Any]], open_end: bool = False, **extra: Any
) -> list[int]:
    """The messages' token ids through the tokenizer's chat template, the assistant's turn
    started after them; without a template, as ``role: content`` lines then
    ``assistant:``. ``open_end``: the last message is left open instead (vLLM's
    ``continue_final_message``: no end of its turn, no assistant turn after it)."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=not open_end,
            continue_final_message=open_end,
            tokenize=True,
            **extra,
        )
        return token_ids(out)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    text = text.rstrip("\n") if open_end else text + "assistant:"
    return [int(i) for i in tokenizer.encode(text)]
