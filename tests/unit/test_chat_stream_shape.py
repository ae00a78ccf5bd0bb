"""The streamed chat body with audio, built from hand-made stage outputs: transcript
pieces join into readable text."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from omnistage.api.routes.chat import _events, _Plan
from omnistage.api.routes.common import ChunkShape
from omnistage.protocol.messages import OutputChunk


class _Stream:
    request_id = "chatcmpl-1"

    def close(self) -> None:
        pass

    def usage(self) -> dict[str, int]:
        return {}


async def _outputs(chunks: list[OutputChunk]) -> AsyncIterator[OutputChunk]:
    for chunk in chunks:
        yield chunk


def _audio(seq: int, text: str, finished: bool = False) -> OutputChunk:
    return OutputChunk("r", 1, 0, 1, seq, "audio", text, b"\x00\x01", finished=finished)


async def test_transcript_pieces_keep_the_spaces_between_sentences() -> None:
    plan = _Plan(text=[0], audio=[1], audio_format="pcm16")
    shape = ChunkShape("chatcmpl-1", "chat.completion.chunk", 0, "voice", False)
    chunks = [
        OutputChunk("r", 0, 0, 1, 0, "text", "AI, here. Hi!", finished=True),
        _audio(0, "AI,"),
        _audio(1, "here."),
        _audio(2, "Hi!", finished=True),
    ]
    body = b"".join([e async for e in _events(_outputs(chunks), _Stream(), shape, plan)])
    transcript = ""
    for line in body.decode().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                transcript += choice["delta"].get("audio", {}).get("transcript", "")
    assert transcript == "AI, here. Hi!"
