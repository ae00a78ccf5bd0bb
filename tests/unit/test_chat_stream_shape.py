"""The streamed chat body with audio, built from hand-made stage outputs: OpenAI's chunk
shape, where the words go out once, as the audio's transcript."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from omnistage.api.routes.chat import _events, _Plan
from omnistage.api.routes.common import ChunkShape
from omnistage.protocol.chunk_meta import ToolCallMeta
from omnistage.protocol.messages import OutputChunk, Usage


class _Stream:
    request_id = "chatcmpl-1"

    def close(self) -> None:
        pass

    def usage(self) -> Usage:
        return Usage()


async def _outputs(chunks: list[OutputChunk]) -> AsyncIterator[OutputChunk]:
    for chunk in chunks:
        yield chunk


def _audio(seq: int, text: str, finished: bool = False) -> OutputChunk:
    pcm = b"\x00\x01" * 2205  # 0.1 s at 22050 Hz
    return OutputChunk("r", 1, 0, 1, seq, "audio", text, pcm, finished=finished)


def _events_of(body: bytes) -> list[dict]:
    return [
        json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")
    ]


async def test_with_audio_the_text_is_the_transcript_and_audio_chunks_carry_data_only() -> None:
    plan = _Plan(text=[0], audio=[1], audio_format="pcm16")
    shape = ChunkShape("chatcmpl-1", "chat.completion.chunk", 0, "voice", False)
    chunks = [
        OutputChunk("r", 0, 0, 1, 0, "text", "AI, here."),
        _audio(0, "AI,"),
        OutputChunk("r", 0, 0, 1, 1, "text", " Hi!", finished=True),
        _audio(1, "here."),
        _audio(2, "Hi!", finished=True),
    ]
    body = b"".join([e async for e in _events(_outputs(chunks), _Stream(), shape, plan)])
    events = _events_of(body)
    deltas = [c["delta"] for e in events for c in e["choices"]]
    # The opening delta announces the audio (id, expiry) with an empty transcript.
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"] is None
    assert deltas[0]["audio"]["transcript"] == "" and deltas[0]["audio"]["expires_at"] > 0
    assert not any(d.get("content") for d in deltas)
    transcript = "".join(d.get("audio", {}).get("transcript", "") for d in deltas)
    assert transcript == "AI, here. Hi!"
    data_deltas = [d["audio"] for d in deltas if "data" in d.get("audio", {})]
    assert data_deltas and all("transcript" not in a for a in data_deltas)
    assert all(a["id"] == deltas[0]["audio"]["id"] for a in data_deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def test_tool_call_pieces_stream_as_openai_tool_call_deltas() -> None:
    plan = _Plan(text=[0], audio=[], audio_format="")
    shape = ChunkShape("chatcmpl-7", "chat.completion.chunk", 0, "voice", False)
    meta = ToolCallMeta(index=0, name="get_weather")
    chunks = [
        OutputChunk("r", 0, 0, 1, 0, "tool_call", '{"city":', meta=meta),
        OutputChunk("r", 0, 0, 1, 1, "tool_call", '"Paris"}', meta=meta),
        OutputChunk(
            "r", 0, 0, 1, 2, "tool_call", "", finished=True, finish_reason="tool_calls", meta=meta
        ),
    ]
    body = b"".join([e async for e in _events(_outputs(chunks), _Stream(), shape, plan)])
    calls = [
        c["delta"]["tool_calls"][0]
        for e in _events_of(body)
        for c in e["choices"]
        if c["delta"].get("tool_calls")
    ]
    assert calls[0]["id"] == "call_7_0" and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "get_weather"
    assert all("id" not in c and c["index"] == 0 for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city":"Paris"}'
    assert _events_of(body)[-1]["choices"][0]["finish_reason"] == "tool_calls"
