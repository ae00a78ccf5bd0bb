"""The official ``openai`` SDK's realtime client over a real echo head: every event the
server sends for a text answer parses as the SDK's own typed event (the echo pipeline
has no audio stage; tests/models/test_realtime.py speaks)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import HeadProc

openai = pytest.importorskip("openai")


@pytest.fixture
def head(tmp_path: Path) -> Iterator[HeadProc]:
    head = HeadProc(tmp_path, "echo")
    try:
        head.wait_healthy()
        yield head
    finally:
        head.stop()


async def _answer(head: HeadProc) -> list[Any]:
    """Say "hello"; the events the SDK parsed, up to ``response.done``."""
    client = openai.AsyncOpenAI(
        base_url=f"{head.url}/v1",
        api_key="unused",
        websocket_base_url=head.url.replace("http://", "ws://") + "/v1",
    )
    seen = []
    async with client.realtime.connect(model="echo") as conn:
        seen.append(await conn.recv())
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
        content = [{"type": "input_text", "text": "hello"}]
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": content}
        )
        await conn.response.create()
        async for event in conn:
            seen.append(event)
            if event.type == "response.done":
                break
    return seen


def test_the_sdk_parses_every_event_of_an_answer(head: HeadProc) -> None:
    events = asyncio.run(asyncio.wait_for(_answer(head), 60))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "session.created",
        "session.updated",
        "conversation.item.added",
        "conversation.item.done",
    ]
    assert "response.output_text.delta" in kinds and "error" not in kinds, str(kinds)
    # Each is the SDK's model for its type (a type it did not know would not be).
    assert all(type(e).__module__.startswith("openai.types.realtime") for e in events)
    done = events[-1]
    assert done.response.status == "completed" and done.response.output[0].role == "assistant"
