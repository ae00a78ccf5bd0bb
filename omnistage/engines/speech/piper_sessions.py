"""A Piper voice's ONNX sessions: the shared one, and a wide one for a lone opening.

Piper runs one onnxruntime session per voice, its thread count fixed when it loads. The
talker synthesizes several answers side by side, each on its own thread
(``TtsArgs.threads``: the cores shared out among ``max_concurrent``), which is what many
sessions need. An answer's first piece is different when nothing else is being
synthesized: its listener waits for it, and the talker's other threads are idle, so it
runs on a second session of the same voice with more threads (``opening_threads``: all
the cores by default). On the 2-core VM "The capital of France" took 52 ms on one thread
and 33 ms on two (``bench/bench_turns.py`` measures what that gives the first audio). It
costs a second copy of the voice's weights (~60 MB for a medium voice).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omnistage.engines.speech.voices import VoiceInfo
from omnistage.protocol.errors import EngineError

if TYPE_CHECKING:
    from piper import PiperVoice


@dataclass(frozen=True)
class VoiceSessions:
    """One voice, loaded: ``shared`` for any synthesis, ``wide`` (None: not loaded, as
    where it would have no more threads) for an answer's opening run alone."""

    shared: PiperVoice
    wide: PiperVoice | None = None

    def pick(self, alone: bool) -> PiperVoice:
        return self.wide if alone and self.wide is not None else self.shared


def load_sessions(voice: VoiceInfo, threads: int, wide_threads: int) -> VoiceSessions:
    try:
        shared = piper_voice(voice, threads)
        wide = piper_voice(voice, wide_threads) if wide_threads > threads else None
    except Exception as exc:
        raise EngineError(f"could not load voice {voice.id} ({voice.model_path}): {exc}") from exc
    return VoiceSessions(shared, wide)


def piper_voice(voice: VoiceInfo, threads: int) -> PiperVoice:
    """Piper's voice, with an ONNX session whose threads sleep when idle.

    ``PiperVoice.load`` gives onnxruntime's defaults, whose worker threads spin after
    every sentence; the talker shares the cores with the thinker that feeds it, and a
    spinning talker slows the next sentence's words."""
    import onnxruntime
    from piper import PiperVoice
    from piper.config import PiperConfig

    opts = onnxruntime.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    with open(voice.config_path, encoding="utf-8") as f:
        config = PiperConfig.from_dict(json.load(f))
    session = onnxruntime.InferenceSession(
        str(voice.model_path), sess_options=opts, providers=["CPUExecutionProvider"]
    )
    return PiperVoice(config=config, session=session)


def synthesize_blocking(
    voice: PiperVoice,
    text: str,
    length_scale: float,
    stop: threading.Event,
    noise: tuple[float | None, float | None] = (None, None),
) -> bytes:
    from piper import SynthesisConfig

    # Relative to the voice's own pace (its config's length_scale, usually 1).
    config = SynthesisConfig(
        length_scale=length_scale * voice.config.length_scale,
        noise_scale=noise[0],
        noise_w_scale=noise[1],
    )
    pcm = bytearray()
    # Piper yields one AudioChunk per sentence espeak finds in the text.
    for audio in voice.synthesize(text, syn_config=config):
        if stop.is_set():
            break
        pcm += audio.audio_int16_bytes
    return bytes(pcm)
