"""A Piper voice cut in two at its decoder, so that an answer's opening is heard sooner.

A Piper voice (VITS) is one ONNX graph: its text encoder, duration predictor and flow
make the latent frames (one per ``hop_length`` samples, 256 at 22,050 Hz), and its
decoder (HiFi-GAN) turns them into audio. Run whole, the first sample comes out with the
last. The decoder is most of the work (62% of "The capital of France is" in
onnxruntime's profile, the frames 38%), and a convolution only reaches a few frames
each way: cut at the decoder's input (``split``), the frames are made first, and the
first ``FIRST_FRAMES`` frames' audio is decoded on its own, with ``CONTEXT_FRAMES``
more of them beyond the cut for the convolutions' reach, then the rest. That audio is
the audio decoded whole (measured: 127 dB apart at 16 frames of context, 67 dB at 8, 32
at 4). The opening phrase's first 0.28 s are then heard after about half of its
synthesis instead of all of it; the rest is made while they play.

The rest must be made before those 0.28 s have played, or the listener hears a gap
where a whole opening had none. On busy cores it may not be: the cut is made only where
the rest's decoding, reckoned from how long the frames just took (``DECODE_PER_ENCODE``),
would take at most ``HEADROOM`` of the first part's audio.

Piper scales each sentence to full scale by its peak (``SynthesisConfig.normalize_audio``,
its default), which a first part cannot know yet. The first part is scaled by its own
peak, and the rest of its sentence by the same gain, softly limited above ``KNEE`` where
it is louder: on 20 opening phrases the first 24 frames held the sentence's peak in 13,
and 74-95% of it in the others.

A graph whose decoder is not one block named ``/dec/`` fed by one tensor (as Piper's
trainer exports it, one speaker) is not cut: its voice runs whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from piper import PiperVoice, SynthesisConfig

log = logging.getLogger(__name__)

DECODER = "/dec/"  # the decoder's node names start with this in Piper's exports
# Frames of audio in an opening's first part: 0.28 s at 22,050 Hz, decoded in ~40% of
# the time all of "The capital of France is" (137 frames) takes.
FIRST_FRAMES = 24
# Frames beyond a cut that the decoder sees on either side, so that each part's audio
# is the whole decode's (see the module's docstring).
CONTEXT_FRAMES = 16
# A sentence shorter than this is decoded whole: its first part would be most of it.
SPLIT_FRAMES = 2 * FIRST_FRAMES + CONTEXT_FRAMES
# The decoder's time per frame against the frames' own (encoder, duration predictor and
# flow), from one sentence's: 62% against 38% in onnxruntime's profile of one (1.6); on
# a Zen 3 VM, 5 openings, 1.9-2.4 on one thread, 1.3-2.0 on two. The larger, so that a
# doubtful cut is not made.
DECODE_PER_ENCODE = 2.3
# The share of the first part's audio (0.28 s) within which the rest must be decoded to
# cut: what is left (56 ms, beside the reckoning's own margin) is for the event loop, the
# network and a busier moment. At 0.6, on a Zen 3 VM 3-4x slower than the others here,
# one session's openings (two threads, beside the thinker) went whole too often: first
# audio p50 0.89 s (server_vad) against 0.70 s cut every time, 0.91 s never.
HEADROOM = 0.8
# Above this, the rest of a sentence louder than its first part is softly limited.
KNEE = 0.9
PCM_MAX = 32767.0  # Piper's own int16 scale


def split(model: str | bytes) -> tuple[bytes, bytes, str] | None:
    """The voice's graph cut at its decoder's input: (frames graph, decoder graph, the
    frames' tensor name), or None where it has no such cut."""
    import onnx
    import onnx.utils

    proto = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(model)
    graph = proto.graph
    decoder = [node for node in graph.node if node.name.startswith(DECODER)]
    made = {name for node in decoder for name in node.output}
    weights = {w.name for w in graph.initializer}
    feeds = {
        name
        for node in decoder
        for name in node.input
        if name and name not in made and name not in weights
    }
    if len(feeds) != 1:
        return None  # no decoder block, or one fed by more (a speaker's embedding)
    (frames,) = feeds
    if frames not in {info.name for info in graph.value_info}:  # the cut needs its type
        info = onnx.helper.make_tensor_value_info(frames, onnx.TensorProto.FLOAT, None)
        graph.value_info.append(info)
    extractor = onnx.utils.Extractor(proto)
    inputs = [i.name for i in graph.input]
    audio = graph.output[0].name
    encoder = extractor.extract_model(inputs, [frames])
    decode = extractor.extract_model([frames], [audio])
    return encoder.SerializeToString(), decode.SerializeToString(), frames


class StagedVoice:
    """A Piper voice run as its two halves (``split``): what the talker needs of
    ``PiperVoice`` (``config``, ``synthesize``), with an opening in two parts."""

    def __init__(
        self,
        piper: PiperVoice,
        encoder: Any,
        decoder: Any,
        frames: str,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.piper = piper
        self.config = piper.config
        self._encoder = encoder  # onnxruntime sessions
        self._decoder = decoder
        self._frames = frames
        self._clock = clock

    def synthesize(
        self,
        text: str,
        config: SynthesisConfig,
        early: Callable[[bytes], None] | None = None,
    ) -> Iterator[bytes]:
        """``text``'s audio (pcm16), one part per sentence, as ``PiperVoice.synthesize``
        makes it. With ``early`` (an answer's opening), a first sentence of at least
        ``SPLIT_FRAMES`` frames is made in two parts, where the rest would be in time
        (``in_time``): its first ``FIRST_FRAMES`` frames' audio goes to ``early`` as soon
        as it is made, and the rest is yielded."""
        for phonemes in self.piper.phonemize(text):
            if not phonemes:
                continue
            started = self._clock()
            frames = self._encoder.run(None, self._inputs(phonemes, config))[0]
            encoded_s = self._clock() - started
            give, early = early, None  # the first sentence only
            if give is None or not self.in_time(frames.shape[2], encoded_s):
                yield _pcm(_normalized(self._decode(frames)))
                continue
            hop, cut = self.config.hop_length, FIRST_FRAMES
            head = self._decode(frames[:, :, : cut + CONTEXT_FRAMES])[: cut * hop]
            peak = float(np.max(np.abs(head)))
            gain = 1.0 / peak if peak >= 1e-8 else 0.0
            give(_pcm(head * gain))
            tail = self._decode(frames[:, :, cut - CONTEXT_FRAMES :])[CONTEXT_FRAMES * hop :]
            yield _pcm(limited(tail * gain))

    def in_time(self, frames: int, encoded_s: float) -> bool:
        """Whether a sentence of ``frames`` frames, made in ``encoded_s``, is worth cutting:
        long enough, and its rest decoded well before its first part has played."""
        if frames < SPLIT_FRAMES:
            return False
        rest = (frames - FIRST_FRAMES + CONTEXT_FRAMES) / frames
        first_s = FIRST_FRAMES * self.config.hop_length / self.config.sample_rate
        return encoded_s * DECODE_PER_ENCODE * rest <= HEADROOM * first_s

    def _inputs(self, phonemes: list[str], config: SynthesisConfig) -> dict[str, np.ndarray]:
        own = self.config
        ids = self.piper.phonemes_to_ids(phonemes)
        scales = [
            own.noise_scale if config.noise_scale is None else config.noise_scale,
            own.length_scale if config.length_scale is None else config.length_scale,
            own.noise_w_scale if config.noise_w_scale is None else config.noise_w_scale,
        ]
        return {
            "input": np.array([ids], dtype=np.int64),
            "input_lengths": np.array([len(ids)], dtype=np.int64),
            "scales": np.array(scales, dtype=np.float32),
        }

    def _decode(self, frames: np.ndarray) -> np.ndarray:
        return self._decoder.run(None, {self._frames: frames})[0].reshape(-1)


def _normalized(audio: np.ndarray) -> np.ndarray:
    """Scaled to full scale by its peak, as Piper does by default."""
    peak = float(np.max(np.abs(audio))) if audio.size else 0.0
    return audio / peak if peak >= 1e-8 else np.zeros_like(audio)


def limited(audio: np.ndarray) -> np.ndarray:
    """Samples above ``KNEE`` bent smoothly towards 1 (a soft limiter): continuous, with
    the same slope at the knee, and never past full scale."""
    over = np.abs(audio) > KNEE
    if not over.any():
        return audio
    out = audio.copy()
    excess = (np.abs(audio[over]) - KNEE) / (1 - KNEE)
    out[over] = np.sign(audio[over]) * (KNEE + (1 - KNEE) * np.tanh(excess))
    return out


def _pcm(audio: np.ndarray) -> bytes:
    return np.clip(audio * PCM_MAX, -PCM_MAX, PCM_MAX).astype(np.int16).tobytes()
