"""Listening while the user speaks: a listener head (Whisper tiny.en, real replica
processes) fed Piper's speech in 100 ms pieces through ``OutputStream.feed``, driven in
this process as the realtime route will. Slow tests.

The streamed transcript must match the spoken words, arrive stretch by stretch, and after
the last piece leave only the audio since the last pause to transcribe: measured here
against the same utterance transcribed at once. A listener killed mid-stream is replaced
and the transcript still arrives whole.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from omnistage.config.load import validate_config
from omnistage.config.schema import DeployConfig, StageConfig
from omnistage.engines.base import EngineRequest
from omnistage.engines.speech.tts import TtsEngine
from omnistage.head.process import Head
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import OutputChunk, Prompt
from tests import params as P
from tests.integration.inproc_head import kill_replica, running_head, until
from tests.models.test_asr_engine import no_inputs, word_errors

pytestmark = pytest.mark.slow
module_loop = pytest.mark.asyncio(loop_scope="module")

# About 4.5 s as the Piper voice says it, with a speaker's pause between the sentences
# (Piper's own gap between sentences, ~130 ms, is shorter than a pause the listener cuts at).
FIRST = "The quick brown fox jumps over the lazy dog."
SECOND = "Please call me tomorrow morning."
UTTERANCE = f"{FIRST} {SECOND}"
PAUSE_S = 0.4
PIECE_S = 0.1
TRAILING_SILENCE_S = 0.5  # what a client's turn detection waits before it commits


def listener_only() -> DeployConfig:
    return validate_config(
        {
            "pipeline": "listener",
            "stages": [
                {
                    "stage_id": 0,
                    "name": "listener",
                    "engine": "asr",
                    "engine_args": {"model": "tiny.en"},
                    "prompt_modalities": ["audio"],
                    "final_output": True,
                    "output_modality": "text",
                }
            ],
        },
        "listener-only",
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def speech() -> tuple[bytes, int]:
    """The utterance as Piper says it, a pause in the middle, then a little silence:
    (pcm16, rate)."""
    # Without the voice's noise: the same take every run (tests/speech.py says why).
    quiet = {"noise_scale": 0.0, "noise_w_scale": 0.0}
    talker = StageConfig(
        stage_id=1, name="talker", engine="tts", engine_args=quiet, output_modality="audio"
    )
    engine = TtsEngine(talker)
    await engine.start()
    said: list[bytes] = []
    for text in (FIRST, SECOND):
        request = EngineRequest("say", Prompt(text=text), P.speech(), no_inputs())
        chunks = [c async for c in engine.generate(request)]
        rate = chunks[0].meta.sample_rate  # type: ignore[union-attr]
        said.append(b"".join(c.data for c in chunks))
    await engine.shutdown()
    assert rate

    def silence(seconds: float) -> bytes:
        return bytes(2 * round(rate * seconds))

    return said[0] + silence(PAUSE_S) + said[1] + silence(TRAILING_SILENCE_S), rate


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def head() -> AsyncIterator[Head]:
    async with running_head(listener_only(), replicas=2, start_timeout_s=180) as head:
        yield head


def _pieces(pcm: bytes, rate: int) -> list[bytes]:
    size = 2 * round(rate * PIECE_S)
    return [pcm[i : i + size] for i in range(0, len(pcm), size)]


class Heard:
    """A request's output chunks, with when each arrived."""

    def __init__(self) -> None:
        self.chunks: list[tuple[float, OutputChunk]] = []

    async def collect(self, stream: AsyncIterator[OutputChunk]) -> None:
        async for chunk in stream:
            self.chunks.append((time.perf_counter(), chunk))

    @property
    def text(self) -> str:
        return "".join(c.text for _, c in self.chunks)

    @property
    def done_at(self) -> float:
        return self.chunks[-1][0]


async def _stream(
    head: Head, rid: str, pcm: bytes, rate: int, kill_after: int = -1
) -> tuple[Heard, float]:
    """Feed ``pcm`` in 100 ms pieces at the pace it plays; (what was heard, when the last
    piece was fed). With ``kill_after``, SIGKILL the replica listening after that many."""
    first = Prompt(audio=b"", audio_format="pcm16", sample_rate=rate)
    stream = await head.service.open(PipelineRequest(rid, first, [0], input_streaming=True))
    heard = Heard()
    reader = asyncio.create_task(heard.collect(aiter(stream)))
    for i, piece in enumerate(_pieces(pcm, rate)):
        if i == kill_after:
            (holder,) = [h for h in head.pools[0].replicas.values() if rid in h.requests]
            kill_replica(head, 0, holder.replica_id)
        stream.feed(piece)
        await asyncio.sleep(PIECE_S)
    stream.feed(b"", last=True)
    last_at = time.perf_counter()
    await asyncio.wait_for(reader, 60)
    return heard, last_at


@module_loop
async def test_streamed_speech_is_heard_stretch_by_stretch_and_ends_quickly(
    head: Head, speech: tuple[bytes, int]
) -> None:
    pcm, rate = speech
    heard, last_at = await _stream(head, "listen-1", pcm, rate)
    *segments, final = [c for _, c in heard.chunks]
    assert word_errors(heard.text, UTTERANCE) <= 2, heard.text
    assert "  " not in heard.text
    assert final.finished and final.meta is not None and final.meta.language == "en"
    assert final.meta.duration == pytest.approx(len(pcm) / 2 / rate, abs=0.01)
    metas = [c.meta.segment for c in segments if c.meta and c.meta.segment]
    assert [s.id for s in metas] == list(range(len(metas)))
    assert all(a.start <= b.start for a, b in itertools.pairwise(metas))
    # Text arrived while the speech was still coming in (the first sentence's pause).
    first_text_at = next(t for t, c in heard.chunks if c.text)
    assert first_text_at < last_at
    streamed_s = heard.done_at - last_at

    # The same audio transcribed at once, as a non-streamed request.
    whole = Prompt(audio=pcm, audio_format="pcm16", sample_rate=rate)
    started = time.perf_counter()
    stream = await head.service.open(PipelineRequest("listen-whole", whole, [0]))
    at_once = Heard()
    await asyncio.wait_for(at_once.collect(aiter(stream)), 60)
    whole_s = at_once.done_at - started
    assert word_errors(at_once.text, UTTERANCE) <= 2, at_once.text
    print(
        f"\n{len(pcm) / 2 / rate:.2f} s of speech: last piece to final chunk "
        f"{streamed_s * 1000:.0f} ms streamed, {whole_s * 1000:.0f} ms transcribed at once"
    )
    assert streamed_s < whole_s


@module_loop
async def test_input_that_ends_right_after_the_speech_leaves_only_the_last_stretch(
    head: Head, speech: tuple[bytes, int]
) -> None:
    """No trailing silence (a client that commits the moment speech stops): the second
    sentence is still to transcribe at ``last``, the first is not. Measured, not timed."""
    pcm, rate = speech
    speech_only = pcm[: len(pcm) - 2 * round(rate * TRAILING_SILENCE_S)]
    heard, last_at = await _stream(head, "listen-abrupt", speech_only, rate)
    assert word_errors(heard.text, UTTERANCE) <= 2, heard.text
    first_text_at = next(t for t, c in heard.chunks if c.text)
    assert first_text_at < last_at
    took_ms = (heard.done_at - last_at) * 1000
    print(f"\nno trailing silence: last piece to final chunk {took_ms:.0f} ms")


@module_loop
async def test_a_listener_killed_mid_stream_is_replaced_and_the_transcript_is_whole(
    head: Head, speech: tuple[bytes, int]
) -> None:
    pcm, rate = speech
    retried = head.orchestrator.retried_total
    heard, _ = await _stream(head, "listen-kill", pcm, rate, kill_after=15)
    assert head.orchestrator.retried_total == retried + 1
    assert word_errors(heard.text, UTTERANCE) <= 2, heard.text
    assert heard.chunks[-1][1].finished
    await until(lambda: len(head.pools[0].live()) == 2, 120)  # restarted for what follows
