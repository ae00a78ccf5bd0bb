"""A chat's spoken input for Qwen2.5-Omni's thinker, prepared as its processor
(``Qwen2_5OmniProcessor``) prepares it: the audio at 16 kHz, Whisper log-mel features
padded to 30 s with their mask, and in the prompt one ``<|AUDIO|>`` token per frame the
audio tower will make, between ``<|audio_bos|>`` and ``<|audio_eos|>``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.messages import Prompt

SAMPLE_RATE = 16_000
PARAM = "input_audio"  # what a 400 about the spoken input names


@dataclass
class AudioInput:
    features: Any  # (1, mel bins, frames) float32: ``input_features``
    mask: Any  # (1, frames) int: ``feature_attention_mask``

    @property
    def tokens(self) -> int:
        """How many ``<|AUDIO|>`` tokens stand for it (the audio tower's output frames)."""
        length = int(self.mask.sum())
        return ((length - 1) // 2 + 1 - 2) // 2 + 1

    def placeholder(self) -> str:
        return "<|audio_bos|>" + "<|AUDIO|>" * self.tokens + "<|audio_eos|>"


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
    """Features as the processor makes them (padded to 30 s, with the mask)."""
    out = extractor(
        audio,
        sampling_rate=SAMPLE_RATE,
        return_attention_mask=True,
        padding="max_length",
        return_tensors="pt",
    )
    return AudioInput(out["input_features"], out["attention_mask"])
