"""A chat's spoken input for an omni thinker, prepared as the model's processor prepares
it: the audio at 16 kHz, Whisper log-mel features with their mask, and in the prompt one
audio token per frame the audio tower will make, between its start and end marks.

Qwen2.5-Omni (``Qwen2_5OmniProcessor``): features padded to 30 s, ``<|AUDIO|>`` between
``<|audio_bos|>`` and ``<|audio_eos|>``. Qwen3-Omni (``Qwen3OmniMoeProcessor``): features
as long as the audio (its tower reads them in windows of ``2 x n_window`` frames, 13
tokens per whole window), ``<|audio_pad|>`` between ``<|audio_start|>`` and
``<|audio_end|>``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.messages import Prompt

SAMPLE_RATE = 16_000
PARAM = "input_audio"  # what a 400 about the spoken input names


# A prompt's audio marks: start, the token per frame, end.
QWEN2_5_MARKS = ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")
QWEN3_MARKS = ("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>")


@dataclass
class AudioInput:
    features: Any  # (1, mel bins, frames) float32: ``input_features``
    mask: Any  # (1, frames) int: ``feature_attention_mask``
    tokens: int  # how many audio tokens stand for it (the audio tower's output frames)
    marks: tuple[str, str, str] = QWEN2_5_MARKS

    def placeholder(self) -> str:
        start, token, end = self.marks
        return start + token * self.tokens + end


def samples(prompt: Prompt) -> Any:
    """The prompt's audio as float32 samples at 16 kHz, mono."""
    import numpy as np

    assert prompt.audio is not None
    if prompt.audio_format == "pcm16":  # raw little-endian int16; its rate is stated
        from omnistage.audio.resample import resample

        pcm = np.frombuffer(prompt.audio, "<i2")
        pcm = resample(pcm, prompt.sample_rate or 24_000, SAMPLE_RATE)
        return pcm.astype(np.float32) / 32768.0
    from faster_whisper.audio import decode_audio

    try:
        decoded = decode_audio(io.BytesIO(prompt.audio), sampling_rate=SAMPLE_RATE)
    except MemoryError:
        raise
    except Exception as exc:  # whatever FFmpeg cannot read in the client's bytes
        detail = str(exc) or type(exc).__name__
        raise BadRequestError(f"could not decode the audio: {detail}", PARAM) from None
    if decoded.size == 0:
        raise BadRequestError("the audio holds no samples", PARAM)
    return decoded


def load_extractor(model: str) -> Any:
    """The checkpoint's Whisper feature extractor (128 mel bins without a config)."""
    from transformers import WhisperFeatureExtractor

    try:
        return WhisperFeatureExtractor.from_pretrained(model)
    except OSError:
        return WhisperFeatureExtractor(feature_size=128)


def prepare(extractor: Any, audio: Any) -> AudioInput:
    """Features as Qwen2.5-Omni's processor makes them (padded to 30 s, with the mask)."""
    out = extractor(
        audio,
        sampling_rate=SAMPLE_RATE,
        return_attention_mask=True,
        padding="max_length",
        return_tensors="pt",
    )
    length = int(out["attention_mask"].sum())
    tokens = ((length - 1) // 2 + 1 - 2) // 2 + 1
    return AudioInput(out["input_features"], out["attention_mask"], tokens)


def prepare_qwen3(extractor: Any, audio: Any, n_window: int) -> AudioInput:
    """Features as Qwen3-Omni's processor makes them (as long as the audio, with the
    mask); ``n_window`` is the audio tower's."""
    out = extractor(
        audio,
        sampling_rate=SAMPLE_RATE,
        return_attention_mask=True,
        padding=True,
        truncation=False,
        return_tensors="pt",
    )
    length = int(out["attention_mask"].sum())
    window = n_window * 2
    rest = (length % window - 1) // 2 + 1
    tokens = ((rest - 1) // 2 + 1 - 1) // 2 + 1 + (length // window) * 13
    return AudioInput(out["input_features"], out["attention_mask"], tokens, QWEN3_MARKS)
