"""Short clips through Whisper with a short encoder window.

Whisper reads 30 s of audio per window, and faster-whisper pads a 2 s question to all
30 s: on a CPU the encoder's cost is then fixed at its most (~0.4 s for tiny.en on one
core of the 2-core test machine), whatever the clip's length. CTranslate2's encoder
takes a shorter input (as whisper.cpp's ``audio_ctx`` does), and a 10 s window reads a
clip of up to ``MAX_CLIP_S`` as well as 30 s do in our tests, at about a sixth of the
cost. That is the common case of live voice, where each phrase is a few seconds.

The shorter window makes one failure likelier: on very short clips the decoder may
repeat itself ("Hello? Hello? Hello?"). The result is checked as faster-whisper checks
its own (the compression ratio of a looping text, the mean log probability) and a
repeated phrase is caught by its period; a result that fails returns None, and the
caller transcribes the clip the usual way, with the full window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# Clips up to this long take the short window: it must hold them with room to spare.
MAX_CLIP_S = 8.0
WINDOW_FRAMES = 1000  # 10 s of 10 ms frames
# faster-whisper's own thresholds for a transcript it does not trust.
MAX_COMPRESSION_RATIO = 2.4
MIN_AVG_LOGPROB = -1.0
# The most tokens a second of speech can plausibly need, plus a margin for short clips.
TOKENS_PER_S, TOKEN_MARGIN = 10, 12


@dataclass(frozen=True)
class ShortResult:
    """The clip as one segment, with the fields faster-whisper's segments have."""

    text: str
    avg_logprob: float
    tokens: list[int]
    duration: float
    compression_ratio: float
    start: float = 0.0
    seek: int = 0
    temperature: float = 0.0
    no_speech_prob: float = 0.0

    @property
    def end(self) -> float:
        return self.duration


@dataclass(frozen=True)
class ShortInfo:
    """What faster-whisper's TranscriptionInfo says that callers read."""

    language: str
    duration: float


def transcribe_short(
    model: Any, samples: np.ndarray, language: str | None, prompt: str | None
) -> ShortResult | None:
    """``samples`` (16 kHz float32) transcribed with a short window, or None when the
    clip is too long for it, the model must detect the language, or the result does
    not look right (see module docstring)."""
    import ctranslate2
    from faster_whisper.tokenizer import Tokenizer
    from faster_whisper.transcribe import get_compression_ratio, get_suppressed_tokens

    duration = len(samples) / model.feature_extractor.sampling_rate
    multilingual = model.model.is_multilingual
    if duration > MAX_CLIP_S or duration <= 0 or (multilingual and language is None):
        return None
    features = model.feature_extractor(samples)
    window = np.zeros((1, features.shape[0], WINDOW_FRAMES), dtype=np.float32)
    frames = min(features.shape[-1], WINDOW_FRAMES)
    window[0, :, :frames] = features[:, :frames]
    tokenizer = Tokenizer(
        model.hf_tokenizer, multilingual, task="transcribe", language=language or "en"
    )
    encoded = model.model.encode(ctranslate2.StorageView.from_array(window), to_cpu=False)
    prompt_ids = _prompt(tokenizer, prompt)
    budget = int(TOKEN_MARGIN + TOKENS_PER_S * duration)
    result = model.model.generate(
        encoded,
        [prompt_ids],
        beam_size=1,
        max_length=_max_length(len(prompt_ids), budget),
        return_scores=True,
        suppress_blank=True,
        suppress_tokens=get_suppressed_tokens(tokenizer, (-1,)),
    )[0]
    tokens = [t for t in result.sequences_ids[0] if t < tokenizer.eot]
    text = tokenizer.decode(tokens).strip()
    avg_logprob = result.scores[0] if result.scores else 0.0
    # A decode that used its whole budget was cut off (a loop, or not the clip's words).
    if not tokens or len(tokens) >= budget or _repeats(tokens):
        return None
    ratio = get_compression_ratio(text)
    if ratio > MAX_COMPRESSION_RATIO or avg_logprob < MIN_AVG_LOGPROB:
        return None
    # Segments carry the text with its leading space, as faster-whisper's do.
    return ShortResult(" " + text, float(avg_logprob), tokens, duration, ratio)


def _prompt(tokenizer: Any, previous: str | None) -> list[int]:
    """Whisper's prompt: optional previous text, then start-of-transcript, no timestamps."""
    out: list[int] = []
    if previous:
        out.append(tokenizer.sot_prev)
        out.extend(tokenizer.encode(" " + previous.strip())[-223:])
    out.extend(tokenizer.sot_sequence)
    out.append(tokenizer.no_timestamps)
    return out


def _max_length(prompt_len: int, budget: int) -> int:
    """CTranslate2's ``max_length`` for ``budget`` new tokens after a prompt: its Whisper
    counts the prompt in ``max_length`` and generates at most half of it (measured with
    ctranslate2 4.x: new tokens = min(L // 2, L - prompt_len + 1)), so a bare budget
    would cut the text short, silently, after a previous-text prompt."""
    return max(2 * budget, prompt_len + budget)


def _repeats(tokens: list[int], min_period: int = 1) -> bool:
    """True if the text ends in the same run of tokens twice over (a decoding loop):
    a period p with the last 2p tokens being one run repeated, p covering >= 2 tokens or
    a single token repeated 4 times."""
    n = len(tokens)
    for period in range(min_period, n // 2 + 1):
        if tokens[n - period :] == tokens[n - 2 * period : n - period]:
            if period >= 2:
                return True
            if n >= 4 and len(set(tokens[-4:])) == 1:
                return True
    return False
