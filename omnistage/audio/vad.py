"""Server VAD on streamed audio: the Silero model faster-whisper ships, fed chunk by chunk.

``SileroVad`` wraps ``faster_whisper/assets/silero_vad_v6.onnx`` for streaming. The model
scores 512-sample windows of 16 kHz audio (32 ms), each preceded by the last 64 samples of
the window before it (its "context"), and carries an LSTM state ``h``/``c`` from window to
window. faster-whisper scores a whole file in one call with that state starting at zero; a
live session arrives in arbitrary chunks, so here the state, the context and any samples
short of a full window are kept between calls, and feeding a session's audio in any split
gives the same probabilities as feeding it at once.

``VadStream`` is one session's front: it takes Realtime's ``audio/pcm`` (PCM16 little-endian
mono, 24 kHz, or 16 kHz), resamples to 16 kHz, scores it and runs the windows through a
``server_vad.TurnDetector`` (or, for ``semantic_vad``, a ``semantic_vad.SemanticTurnDetector``,
for which it also keeps the last seconds of audio for the end-of-turn model to hear),
returning the events each chunk completes with times counted from the first byte fed.

Given a ``verdicts.VerdictPool``, a semantic stream runs the end-of-turn model on the pool's
worker thread instead of inside ``feed``: ``verdicts()`` hands out each question asked as a
coroutine, which the caller awaits (on its event loop) for the events its verdict completes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from omnistage.audio.resample import StreamResampler
from omnistage.audio.semantic_vad import Question, SemanticTurnDetector, SemanticVadParams
from omnistage.audio.server_vad import ServerVadParams, TurnDetector, VadEvent
from omnistage.audio.verdicts import VerdictPool

log = logging.getLogger(__name__)

MODEL_RATE = 16_000
WINDOW = 512  # samples per scored window at 16 kHz: 32 ms
CONTEXT = 64  # samples of the previous window prepended to each one
WINDOW_MS = WINDOW * 1000 // MODEL_RATE
STATE_SHAPE = (1, 1, 128)
INPUT_RATES = (16_000, 24_000)
# Audio kept for the end-of-turn model: the 8 s it hears, and some slack.
KEPT_SAMPLES = 9 * MODEL_RATE

VadParams = ServerVadParams | SemanticVadParams


def silero_model_path() -> Path:
    """The Silero VAD ONNX file inside the installed faster-whisper package."""
    import faster_whisper

    return Path(faster_whisper.__file__).parent / "assets" / "silero_vad_v6.onnx"


class _Session:
    """The ONNX session, loaded once per process and shared (it holds no per-stream state)."""

    _lock = threading.Lock()
    _session = None

    @classmethod
    def get(cls) -> Any:  # onnxruntime.InferenceSession, imported lazily
        with cls._lock:
            if cls._session is None:
                import onnxruntime

                opts = onnxruntime.SessionOptions()
                # One thread, as faster-whisper: a window is ~0.1 ms of work, and sessions of
                # many clients run side by side rather than fighting over cores.
                opts.inter_op_num_threads = 1
                opts.intra_op_num_threads = 1
                opts.enable_cpu_mem_arena = False
                opts.log_severity_level = 4
                cls._session = onnxruntime.InferenceSession(
                    str(silero_model_path()), providers=["CPUExecutionProvider"], sess_options=opts
                )
            return cls._session


def load_silero() -> None:
    """Load the shared ONNX session now (onnxruntime's import and the model: about a
    second the first time, nothing after), e.g. in a worker thread before a session."""
    _Session.get()


class WindowScorer(Protocol):
    """Speech probability per ``WINDOW`` samples of 16 kHz audio, fed in any split."""

    def reset(self) -> None: ...

    def score(self, audio: np.ndarray) -> np.ndarray: ...


class SileroVad:
    """Speech probability per 32 ms window of one audio stream, fed in chunks of any size."""

    def __init__(self) -> None:
        self._session = _Session.get()
        self.reset()

    def reset(self) -> None:
        """Start a new stream: zero recurrent state and context, drop pending samples."""
        self._h = np.zeros(STATE_SHAPE, dtype=np.float32)
        self._c = np.zeros(STATE_SHAPE, dtype=np.float32)
        self._context = np.zeros(CONTEXT, dtype=np.float32)
        self._pending = np.zeros(0, dtype=np.float32)

    def score(self, audio: np.ndarray) -> np.ndarray:
        """Probabilities for each window this 16 kHz float audio (in [-1, 1]) completes.

        Samples short of a full window wait for the next call.
        """
        audio = np.concatenate([self._pending, np.asarray(audio, dtype=np.float32).ravel()])
        count = len(audio) // WINDOW
        self._pending = audio[count * WINDOW :]
        if count == 0:
            return np.zeros(0, dtype=np.float32)
        windows = audio[: count * WINDOW].reshape(count, WINDOW)
        # Each window's context is the tail of the one before; the first takes the tail kept
        # from the previous call (zeros at the start, as faster-whisper's first window).
        contexts = np.concatenate([self._context[None, :], windows[:-1, -CONTEXT:]])
        self._context = windows[-1, -CONTEXT:].copy()
        # The model's first input axis is time: one call runs the LSTM through all windows
        # in order, carrying h/c between them, and returns the state after the last.
        probs, self._h, self._c = self._session.run(
            None,
            {"input": np.concatenate([contexts, windows], axis=1), "h": self._h, "c": self._c},
        )
        return np.asarray(probs, dtype=np.float32).reshape(count)


class VadStream:
    """One session's server VAD: PCM16 mono chunks in, turn events out.

    Times in events count from the first byte fed, in the session's audio (as Realtime's
    ``audio_start_ms``/``audio_end_ms``). ``reset`` (a cleared input buffer) forgets the
    model state and any turn under way but keeps counting time.
    """

    def __init__(
        self,
        params: VadParams | None = None,
        sample_rate: int = 24_000,
        vad: WindowScorer | None = None,
        judge: Callable[[np.ndarray], float] | None = None,
        verdicts: VerdictPool | None = None,
    ) -> None:
        if sample_rate not in INPUT_RATES:
            raise ValueError(f"sample_rate must be one of {INPUT_RATES}, got {sample_rate}")
        self.sample_rate = sample_rate
        self.detector: TurnDetector | SemanticTurnDetector
        # 16 kHz audio since the last reset, its last KEPT_SAMPLES (semantic_vad only).
        self._kept: np.ndarray | None = None
        self._kept_from = 0  # samples since the reset dropped from the front of _kept
        self._pool = verdicts
        self._questions: list[Coroutine[Any, Any, list[VadEvent]]] = []
        if isinstance(params, SemanticVadParams):
            if judge is None:
                from omnistage.audio.smart_turn import SmartTurn

                judge = SmartTurn().probability
            self._model = judge
            self._kept = np.zeros(0, dtype=np.float32)
            self.detector = SemanticTurnDetector(params, None if verdicts else self._judge)
        else:
            self.detector = TurnDetector(params)
        self.vad: WindowScorer = vad if vad is not None else SileroVad()
        # Realtime's 24 kHz pcm, to the model's 16 kHz (the project's polyphase resampler).
        self._resample = StreamResampler(sample_rate, 16_000) if sample_rate != 16_000 else None
        self._odd_byte = b""
        self._samples_in = 0  # whole input samples fed, at sample_rate
        self._windows = 0  # windows scored since the stream (re)started
        self._window_base_ms = 0  # audio time of the first window since the last reset

    @property
    def audio_ms(self) -> float:
        """Audio fed so far, in ms (whole samples only)."""
        return self._samples_in * 1000 / self.sample_rate

    @property
    def speaking(self) -> bool:
        return self.detector.speaking

    def reset(self) -> None:
        """Drop model state, pending audio and any turn; later events keep the session clock."""
        self.vad.reset()
        self.detector.reset()
        if self._resample is not None:
            self._resample = StreamResampler(self.sample_rate, 16_000)
        self._odd_byte = b""
        self._windows = 0
        self._window_base_ms = round(self.audio_ms)
        if self._kept is not None:
            self._kept, self._kept_from = np.zeros(0, dtype=np.float32), 0

    def _judge(self, question: Question) -> float:
        """The end-of-turn model on the question's audio."""
        return self._model(self._audio_of(question))

    def _audio_of(self, question: Question) -> np.ndarray:
        """The kept audio of ``[start_ms, end_ms)``; asked ahead of the audio
        (``semantic_vad.LEAD_MS``, inside a silence), the silence heard so far, repeated,
        stands for what is not heard yet: the room's own noise, not the speech before it
        (nor zeros, which no microphone sends)."""
        assert self._kept is not None
        per_ms = MODEL_RATE // 1000
        lo, hi, silence = (
            max(0, (ms - self._window_base_ms) * per_ms - self._kept_from)
            for ms in (question.start_ms, question.end_ms, question.silence_ms)
        )
        # A view of an array never written again: feeding builds a new one.
        audio = self._kept[lo:hi]
        ahead = hi - lo - len(audio)
        if ahead <= 0:
            return audio
        heard = self._kept[max(lo, silence) : hi]
        if len(heard) == 0:
            heard = np.zeros(1, dtype=np.float32)
        return np.concatenate([audio, np.resize(heard, ahead)])

    def verdicts(self) -> list[Coroutine[Any, Any, list[VadEvent]]]:
        """The questions for the end-of-turn model asked by the audio fed since the last
        call (with a pool only): each, awaited, runs the model off the loop and gives the
        events its verdict completes (none when it came too late to matter)."""
        questions, self._questions = self._questions, []
        return questions

    async def _verdict(self, question: Question, audio: np.ndarray) -> list[VadEvent]:
        detector, pool = self.detector, self._pool
        assert isinstance(detector, SemanticTurnDetector) and pool is not None
        try:
            verdict = await pool.judge(self._model, audio, lambda: detector.wants(question.token))
        except Exception:  # the turn then ends on the longest wait, as if judged unfinished
            log.exception("the end-of-turn model failed")
            return []
        event = None if verdict is None else detector.verdict(question.token, verdict)
        return [] if event is None else [event]

    def words_wanted(self, silence_from: int) -> bool | None:
        """``SemanticTurnDetector.words_wanted`` (False under server VAD)."""
        detector = self.detector
        if not isinstance(detector, SemanticTurnDetector):
            return False
        return detector.words_wanted(silence_from)

    def words(self, silence_from: int, probability: float) -> list[VadEvent]:
        """The words' verdict on the turn at the silence from ``silence_from``
        (``SemanticTurnDetector.words``); the events it completes."""
        detector = self.detector
        if not isinstance(detector, SemanticTurnDetector):
            return []
        event = detector.words(silence_from, probability)
        return [] if event is None else [event]

    def feed(self, pcm: bytes) -> list[VadEvent]:
        """Account a chunk of PCM16 little-endian mono audio; the events it completes."""
        data = self._odd_byte + pcm
        whole = len(data) & ~1
        self._odd_byte = data[whole:]
        pcm16 = np.frombuffer(data[:whole], dtype="<i2")
        self._samples_in += len(pcm16)
        if self._resample is not None:
            pcm16 = self._resample.push(pcm16)
        samples = pcm16.astype(np.float32) / 32768.0
        if self._kept is not None:
            kept = np.concatenate([self._kept, samples])
            drop = max(0, len(kept) - KEPT_SAMPLES)
            self._kept, self._kept_from = kept[drop:], self._kept_from + drop
        events: list[VadEvent] = []
        for probability in self.vad.score(samples):
            start = self._window_base_ms + self._windows * WINDOW_MS
            self._windows += 1
            event = self.detector.push(float(probability), start, start + WINDOW_MS)
            if event is not None:
                events.append(event)
            if self._pool is not None and isinstance(self.detector, SemanticTurnDetector):
                question = self.detector.take_question()
                if question is not None:
                    audio = self._audio_of(question)
                    self._questions.append(self._verdict(question, audio))
        return events
