"""Token logprobs in OpenAI's two response shapes (chat, and legacy completions)."""

from __future__ import annotations

from typing import Any

from omnistage.protocol.messages import TokenLogprob


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion (or of one streamed chunk)."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": e.bytes,
                "top_logprobs": [
                    {"token": t.token, "logprob": t.logprob, "bytes": t.bytes}
                    for t in e.top_logprobs
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: list[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
    """``choices[i].logprobs`` of a legacy completion: parallel lists, offsets into the
    choice's text (``text_offset`` where these tokens start, for a streamed piece)."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in entries],
        "text_offset": offsets,
    }
