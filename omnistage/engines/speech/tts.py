"""The TTS engine: Piper voices (ONNX, CPU) turning text into 16-bit mono PCM.

A source stage speaks its prompt; a downstream stage speaks its upstream text as it
streams in, one sentence at a time, so the first sentence is audible while the rest is
still being written. Each output chunk holds one sentence's raw PCM (little-endian
int16, mono) with an ``AudioMeta`` giving its ``sample_rate`` and ``voice``; packing it
into a container (WAV, ...) is the API layer's business.

Synthesis runs in worker threads, at most ``max_concurrent`` at once, so the replica's
event loop stays free for heartbeats and other requests. Which waiting synthesis a free
slot goes to, which run at a lower scheduling priority (``later_nice``), and when an
answer about to run dry speaks its unfinished sentence to a phrase boundary, is the
``scheduling`` policy's call (``talker_order``): by default the chunks of answers whose
listener is about to run out of audio first, then answers' first chunks, then the
rest, by when each is due. Piper and onnxruntime load only when the engine starts.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from omnistage.config.engine_args import TtsArgs
from omnistage.config.schema import StageConfig
from omnistage.engines.base import Engine, EngineChunk, EngineRequest, prompt_text
from omnistage.engines.priority_slots import PrioritySlots
from omnistage.engines.speech.piper_sessions import (
    VoiceSessions,
    load_sessions,
    synthesize_blocking,
)
from omnistage.engines.speech.sentences import (
    SpokenBefore,
    StreamedPieces,
    SynthesisPace,
    prompt_pieces,
)
from omnistage.engines.speech.talker_order import (
    ChunkOrder,
    DeadlineOrder,
    Piece,
    Playback,
    TalkerOrder,
)
from omnistage.engines.speech.voices import VoiceCatalog, VoiceInfo
from omnistage.engines.torch_threads import cores
from omnistage.protocol.chunk_meta import AudioMeta
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.errors import BadRequestError, EngineError
from omnistage.protocol.messages import Usage
from omnistage.protocol.params import StageParams

log = logging.getLogger(__name__)

MIN_SPEED = 0.25
MAX_SPEED = 4.0
WARMUP_TEXT = "Hello."


class TtsEngine(Engine):
    # A retry skips the sentences already spoken (``SpokenBefore``) instead of making
    # them all again for the runtime to drop: the audio resumes after one sentence.
    supports_resume = True

    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        self.args = TtsArgs.model_validate(stage.engine_args)
        self.catalog: VoiceCatalog | None = None
        self._loads: dict[str, asyncio.Future[VoiceSessions]] = {}
        self._slots = PrioritySlots(self.args.max_concurrent)
        self._order: TalkerOrder = (
            DeadlineOrder(time.monotonic) if self.args.scheduling == "deadline" else ChunkOrder()
        )
        # Syntheses the order says yield the cores run on the second pool, whose
        # threads are niced.
        self._pools = (
            ThreadPoolExecutor(self.args.max_concurrent, thread_name_prefix="tts-first"),
            ThreadPoolExecutor(
                self.args.max_concurrent,
                thread_name_prefix="tts-later",
                initializer=_nice_this_thread,
                initargs=(self.args.later_nice,),
            ),
        )
        self._noise = (self.args.noise_scale, self.args.noise_w_scale)
        self._waiting = 0
        self._running = 0  # syntheses under way
        self.pace = SynthesisPace()
        # Seconds the default voice took to load, and its warm-up synthesis.
        self.load_time_s: float | None = None
        self.warmup_time_s: float | None = None

    @property
    def queue_length(self) -> int:
        # A request synthesizes one sentence at a time, so waiting syntheses are
        # requests waiting for a slot.
        return self._waiting

    async def start(self) -> None:
        self.catalog = await asyncio.to_thread(
            VoiceCatalog.discover,
            self.args.voices_dir,
            self.args.voice,
            self.args.openai_voices,
        )
        voice = self.catalog.default
        log.info(
            "TTS voices: %s; default %s (%d Hz)",
            self.catalog.available(),
            voice.id,
            voice.sample_rate,
        )
        started = time.perf_counter()
        self.starting = f"loading the voice {voice.id}"
        sessions = await self._voice(voice)
        self.load_time_s = time.perf_counter() - started
        started = time.perf_counter()
        self.starting = "warming up"
        pcm = await self._synthesize(sessions, WARMUP_TEXT, length_scale(1.0, self.args.speed))
        if sessions.wide is not None:  # that ran on the wide session (a first piece, alone);
            # an ONNX session's first run is slow: the shared one's is not an answer's either
            await asyncio.to_thread(
                synthesize_blocking, sessions.shared, WARMUP_TEXT, 1.0, threading.Event()
            )
        self.warmup_time_s = time.perf_counter() - started
        if not pcm:
            raise EngineError(f"voice {voice.id} produced no audio when warming up")
        log.info(
            "voice %s loaded in %.2fs, warm-up %.2fs",
            voice.id,
            self.load_time_s,
            self.warmup_time_s,
        )

    async def shutdown(self) -> None:
        for load in self._loads.values():
            load.cancel()
        self._loads.clear()
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)

    def check(self, params: StageParams) -> None:
        self._catalog().resolve(params.speaking.voice)
        length_scale(params.speaking.speed, self.args.speed)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        params = request.params.speaking
        voice = self._catalog().resolve(params.voice)
        scale = length_scale(params.speed, self.args.speed)
        answer = _Answer(self, request, voice, await self._voice(voice), scale)
        if request.prompt is not None:
            text = prompt_text(request.prompt)
            answer.words_in = len(text.split())
            pieces = prompt_pieces(text, self.args.sentence_streaming)
            for piece in pieces[:-1]:
                async for chunk in answer.speak(piece):
                    if chunk.data:
                        yield chunk
            async for chunk in answer.speak(pieces[-1] if pieces else "", finished=True):
                yield chunk
            return
        async for chunk in self._streamed(request, answer):
            yield chunk

    async def _streamed(
        self, request: EngineRequest, answer: _Answer
    ) -> AsyncIterator[EngineChunk]:
        """Streamed text spoken piece by piece as it comes."""
        streamed = StreamedPieces(self.args.sentence_streaming, self.args.first_phrase)
        # Busy cores: the opening goes out with the next piece (SynthesisPace); no retry's.
        hold = not request.resume_text and not self.pace.opening_alone()
        held: EngineChunk | None = None
        async for item in request.inputs:
            if not item.text or item.modality != Modality.TEXT:
                continue  # a function call's arguments are not for speaking
            answer.words_in += len(item.text.split())
            pieces = streamed.add(item.text)
            if not pieces and self._order.hurry(answer.playback, streamed.pending):
                pieces = streamed.phrase()
            for piece in pieces:
                holding = hold and held is None and piece == streamed.opening
                async for chunk in answer.speak(piece, early=not holding):
                    if holding:
                        held = chunk
                        continue
                    for out in (held, chunk):
                        if out is not None and out.data:
                            yield out
                    held = None
        async for last in answer.speak(streamed.rest(), finished=True):
            if last.finished and held is not None and held.data:
                yield held
            yield last  # (before the last: the first part of an answer said at its end)

    def _catalog(self) -> VoiceCatalog:
        if self.catalog is None:
            raise EngineError("the TTS engine has not been started")
        return self.catalog

    async def _voice(self, voice: VoiceInfo) -> VoiceSessions:
        """The loaded voice, loading it on first use (once, however many ask)."""
        load = self._loads.get(voice.id)
        if load is None or (load.done() and (load.cancelled() or load.exception())):
            threads = self.args.threads or max(1, cores() // self.args.max_concurrent)
            wide = self.args.opening_threads or cores()
            load = asyncio.ensure_future(asyncio.to_thread(load_sessions, voice, threads, wide))
            self._loads[voice.id] = load
        # Shielded: a cancelled request must not cancel a load others may wait for.
        return await asyncio.shield(load)

    async def _synthesize(
        self,
        voice: VoiceSessions,
        text: str,
        length_scale: float,
        job: Piece | None = None,
        early: asyncio.Future[bytes] | None = None,
    ) -> bytes:
        """PCM for ``text`` (``job``: which answer's chunk it is; None: warm-up),
        synthesized in a worker thread once the order gives it a free slot, niced if
        the order says it can yield the cores, on the voice's wide session if it is an
        answer's first piece and nothing else is being synthesized (``piper_sessions``).
        With ``early``, a first part may be set there as soon as it is made
        (``piper_stages``), and the rest is returned.

        On cancellation the worker stops at its next sentence's end; the slot stays
        taken until it has, so at most ``max_concurrent`` syntheses ever run.
        """
        job = job or Piece(Playback(), 0, len(text))
        self._waiting += 1
        try:
            await self._slots.acquire(lambda: self._order.key(job))
        finally:
            self._waiting -= 1
        stop = threading.Event()
        started, niced = time.monotonic(), self._order.niced(job)
        wide = job.index == 0 and not niced and not self._running and voice.wide is not None
        given = _Given(early)
        self._running += 1
        try:
            work = asyncio.get_running_loop().run_in_executor(
                self._pools[1 if niced else 0],
                synthesize_blocking,
                voice.pick(alone=wide),
                text,
                length_scale,
                stop,
                self._noise,
                None if early is None else given,
            )
        except BaseException:
            self._running -= 1
            self._slots.release()
            raise
        work.add_done_callback(self._synthesis_done)
        try:
            pcm = await asyncio.shield(work)
        except asyncio.CancelledError:
            stop.set()
            raise
        took = time.monotonic() - started
        if not niced and not wide:  # the order estimates the urgent ones, run unniced,
            # on a shared session's threads (a wide one runs only when the talker is idle)
            self._order.observe(len(text), took)
        if not wide:
            self._paced(took, (given.bytes + len(pcm)) / 2 / voice.shared.config.sample_rate)
        return pcm

    def _paced(self, wall_s: float, audio_s: float) -> None:
        alone = self.pace.opening_alone()
        self.pace.record(wall_s, audio_s)
        if alone != self.pace.opening_alone():
            log.info(
                "synthesis at %.2f s per second of audio (limit %.2f): an answer's opening "
                "phrase %s",
                self.pace.ratio,
                self.pace.limit,
                "goes out alone again" if not alone else "waits for its next piece",
            )

    def _synthesis_done(self, work: asyncio.Future[bytes]) -> None:
        self._running -= 1
        self._slots.release()
        if not work.cancelled() and work.exception() is not None:
            log.debug("synthesis failed", exc_info=work.exception())


class _Answer:
    """One request's speech: its pieces, synthesized in order, one chunk each; an
    answer's first piece its first part first (``piper_stages``), without text."""

    def __init__(
        self,
        engine: TtsEngine,
        request: EngineRequest,
        voice: VoiceInfo,
        sessions: VoiceSessions,
        scale: float,
    ) -> None:
        self._engine = engine
        self._voice, self._sessions, self._scale = voice, sessions, scale
        self._meta = AudioMeta(voice.sample_rate, voice=voice.id)
        self._modality = engine.stage.output_modality
        self.said = 0  # pieces synthesized: an answer's first go before others' later ones
        self.playback = Playback()  # when the listener runs out of what was sent
        self._before = SpokenBefore(request.resume_text)
        self.words_in = 0

    async def speak(
        self, piece: str, finished: bool = False, early: bool = True
    ) -> AsyncIterator[EngineChunk]:
        """The piece's audio: one chunk, or, for an answer's first piece (``early``: unless
        it is held back), its first part as soon as it is made and then the rest, which
        carries the piece's text."""
        pcm = b""
        if piece and self._before.skip(piece):
            piece = ""  # spoken by a replica that failed
        elif piece:
            job = Piece(self.playback, self.said, len(piece))
            self.said += 1
            engine = self._engine
            early = early and not job.index and engine.args.first_part
            first = asyncio.get_running_loop().create_future() if early else None
            synthesis = asyncio.ensure_future(
                engine._synthesize(self._sessions, piece, self._scale, job, first)
            )
            try:
                if first is not None:
                    await asyncio.wait((first, synthesis), return_when=asyncio.FIRST_COMPLETED)
                    if first.done() and first.result():
                        self._played(first.result())
                        yield self._chunk(first.result())
                pcm = await synthesis
            finally:
                synthesis.cancel()  # a closed stream stops its synthesis
            self._played(pcm)
        chunk = self._chunk(pcm, self._before.new_text(piece))
        if finished:
            chunk.finished = True
            chunk.finish_reason = FinishReason.STOP
            chunk.usage = Usage(self.words_in)
        yield chunk

    def _played(self, pcm: bytes) -> None:
        self.playback.sent(len(pcm) / 2 / self._voice.sample_rate, time.monotonic())

    def _chunk(self, pcm: bytes, text: str = "") -> EngineChunk:
        self._engine.progress += 1
        return EngineChunk(self._modality, text=text, data=pcm, meta=self._meta)


class _Given:
    """A synthesis's early part (``synthesize_blocking``'s ``early``), handed from its
    worker thread to the event loop's future."""

    def __init__(self, future: asyncio.Future[bytes] | None) -> None:
        self._future = future
        self._loop = asyncio.get_running_loop()
        self.bytes = 0

    def __call__(self, pcm: bytes) -> None:  # on the worker thread
        self.bytes = len(pcm)
        if self._future is not None:
            self._loop.call_soon_threadsafe(self._settle, pcm)

    def _settle(self, pcm: bytes) -> None:
        if self._future is not None and not self._future.done():
            self._future.set_result(pcm)


def length_scale(speed: float | None, default: float) -> float:
    """Piper's length scale for a requested speed (None: the configured ``default``)."""
    if speed is None:
        speed = default
    if isinstance(speed, bool) or not isinstance(speed, int | float):
        raise BadRequestError(
            f"speed must be a number from {MIN_SPEED} to {MAX_SPEED}, got {speed!r}",
            param="speed",
        )
    if not (math.isfinite(speed) and MIN_SPEED <= speed <= MAX_SPEED):
        raise BadRequestError(
            f"speed must be from {MIN_SPEED} to {MAX_SPEED}, got {speed}", param="speed"
        )
    return 1.0 / float(speed)


def _nice_this_thread(nice: int) -> None:
    """Lower the calling thread's scheduling priority (Linux: nice is per thread).

    Raising a thread's nice needs no privilege; a pool's threads are niced once, when
    they start, and keep it (lowering it again would need CAP_SYS_NICE)."""
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (AttributeError, OSError) as exc:  # not Linux, or refused: run at the default
        log.debug("could not nice a synthesis thread: %s", exc)
