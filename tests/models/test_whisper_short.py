"""Whisper's short encoder window (engines/whisper_short.py) with the real tiny.en, on
sentences the real Piper voice says: slow tests.

The short path must hear what the full 30 s window hears, refuse what it cannot trust
(silence, noise, a clip too long for it), and the engine must take it for streamed
stretches when ``short_window`` is on and not when it is off.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from omnistage.audio.wav import wav_bytes
from omnistage.config.schema import StageConfig
from omnistage.engines.base import EngineRequest
from omnistage.engines.speech import asr
from omnistage.engines.speech.asr import AsrEngine
from omnistage.engines.speech.tts import TtsEngine
from omnistage.engines.speech.whisper_short import MAX_CLIP_S, transcribe_short
from omnistage.protocol.messages import Prompt
from tests import params as P
from tests.models.test_asr_engine import no_inputs, run, say, word_errors, words

pytestmark = pytest.mark.slow
module_loop = pytest.mark.asyncio(loop_scope="module")

# 1 to 6 s as the Piper voice says them: a word, commands, questions, a list.
SENTENCES = [
    "Yes.",
    "Hello.",
    "What time is it?",
    "Turn off the lights in the kitchen.",
    "Please call me tomorrow morning.",
    "Can you tell me a joke about penguins?",
    "The quick brown fox jumps over the lazy dog.",
    "I would like to book a table for two people at seven o'clock tonight.",
    "What is the weather going to be like in Paris this weekend, and should I bring an umbrella?",
    "Remind me to buy milk, eggs, bread and coffee on my way home from work this evening, please.",
]
RATE = 16_000
EDGE_S = 0.3  # silence before and after each sentence, as a cut stretch has


def wer(heard: str, said: str) -> float:
    return word_errors(heard, said) / len(words(said))


def full_text(model: Any, samples: np.ndarray, prompt: str | None = None) -> str:
    segments, _ = model.transcribe(samples, beam_size=1, initial_prompt=prompt)
    return "".join(s.text for s in segments)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[AsrEngine]:
    engine = AsrEngine(StageConfig(stage_id=2, name="listener", engine="asr"))
    await engine.start()
    yield engine
    await engine.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def piper() -> list[tuple[bytes, int]]:
    """Each sentence as Piper says it: (pcm16, rate)."""
    # Without the voice's noise: the same take every run (tests/speech.py says why).
    quiet = {"noise_scale": 0.0, "noise_w_scale": 0.0}
    talker = StageConfig(
        stage_id=1, name="talker", engine="tts", engine_args=quiet, output_modality="audio"
    )
    tts = TtsEngine(talker)
    await tts.start()
    said = [await say(tts, text) for text in SENTENCES]
    await tts.shutdown()
    return said


@pytest.fixture(scope="module")
def clips(piper: list[tuple[bytes, int]]) -> list[np.ndarray]:
    """Each sentence at 16 kHz with EDGE_S of silence around it."""
    from faster_whisper.audio import decode_audio

    edge = np.zeros(round(EDGE_S * RATE), dtype=np.float32)
    out = []
    for pcm, rate in piper:
        speech = decode_audio(io.BytesIO(wav_bytes(pcm, rate)), sampling_rate=RATE)
        out.append(np.concatenate([edge, speech, edge]))
    return out


def test_the_short_window_hears_what_the_full_one_hears(
    engine: AsrEngine, clips: list[np.ndarray]
) -> None:
    same, short_errors, full_errors = 0, 0.0, 0.0
    for said, samples in zip(SENTENCES, clips, strict=True):
        assert len(samples) / RATE <= MAX_CLIP_S
        short = transcribe_short(engine.model, samples, None, None)
        assert short is not None, said
        full = full_text(engine.model, samples)
        same += words(short.text) == words(full)
        short_errors += wer(short.text, said)
        full_errors += wer(full, said)
        # No one sentence much worse than the full window's reading of it.
        assert wer(short.text, said) <= wer(full, said) + 0.2, (said, short.text, full)
        assert short.text.startswith(" ") and short.tokens and short.avg_logprob > -1.0
    assert same >= len(SENTENCES) - 2
    assert short_errors / len(SENTENCES) <= full_errors / len(SENTENCES) + 0.03


def test_previous_text_as_the_prompt_does_not_cut_the_words_short(
    engine: AsrEngine, clips: list[np.ndarray]
) -> None:
    """CTranslate2 counts the prompt in ``max_length``: a long prompt once left room for
    only the first words of the clip."""
    said, samples = SENTENCES[7], clips[7]
    earlier = " ".join(SENTENCES[:7] * 3)  # ~200 tokens, near Whisper's 223 cap
    for prompt in (SENTENCES[6], earlier):
        short = transcribe_short(engine.model, samples, None, prompt)
        assert short is not None, prompt
        assert wer(short.text, said) <= wer(full_text(engine.model, samples, prompt), said)


def test_silence_and_noise_are_refused(engine: AsrEngine) -> None:
    silence = np.zeros(2 * RATE, dtype=np.float32)
    noise = (np.random.default_rng(19).standard_normal(3 * RATE) * 0.05).astype(np.float32)
    assert transcribe_short(engine.model, silence, None, None) is None
    assert transcribe_short(engine.model, noise, None, None) is None


def test_a_clip_longer_than_the_limit_is_left_to_the_full_window(
    engine: AsrEngine, clips: list[np.ndarray]
) -> None:
    long = np.concatenate(clips[6:])
    assert len(long) / RATE > MAX_CLIP_S
    assert transcribe_short(engine.model, long, None, None) is None
    assert transcribe_short(engine.model, np.zeros(0, dtype=np.float32), None, None) is None


@pytest.fixture
def short_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """What each of the engine's calls of transcribe_short returned."""
    calls: list[object] = []

    def counted(*args: Any) -> Any:
        calls.append(result := transcribe_short(*args))
        return result

    monkeypatch.setattr(asr, "transcribe_short", counted)
    yield calls


async def _pieces(pcm: bytes, rate: int) -> AsyncIterator[bytes]:
    size = 2 * round(rate * 0.1)
    for i in range(0, len(pcm), size):
        yield pcm[i : i + size]
        await asyncio.sleep(0)


@module_loop
@pytest.mark.parametrize("short_window", [True, False])
async def test_a_streamed_request_is_heard_with_and_without_the_short_window(
    engine: AsrEngine,
    piper: list[tuple[bytes, int]],
    short_calls: list[object],
    short_window: bool,
) -> None:
    (first, rate), (second, _) = piper[6], piper[4]
    pause = bytes(2 * round(rate * 0.5))
    pcm = first + pause + second + pause
    said = f"{SENTENCES[6]} {SENTENCES[4]}"
    args = engine.args
    engine.args = args.model_copy(update={"short_window": short_window})
    try:
        prompt = Prompt(audio=b"", audio_format="pcm16", sample_rate=rate)
        request = EngineRequest("listen", prompt, P.transcription(), no_inputs())
        request.prompt_chunks = _pieces(pcm, rate)
        chunks = await run(engine, request)
    finally:
        engine.args = args
    text = "".join(c.text for c in chunks)
    assert word_errors(text, said) <= 1, text
    assert chunks[-1].finished and chunks[-1].meta and chunks[-1].meta.language == "en"
    if short_window:  # each stretch (one a sentence) through the short window
        assert len(short_calls) >= 2 and all(r is not None for r in short_calls)
    else:
        assert short_calls == []
