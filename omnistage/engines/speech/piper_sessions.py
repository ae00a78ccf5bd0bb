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

Each session is the voice cut in two at its decoder where its graph allows
(``piper_stages``): an answer's opening then gives its first part as soon as it is made
(``synthesize_blocking``'s ``early``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from omnistage.engines.speech.piper_stages import StagedVoice, split
from omnistage.engines.speech.voices import VoiceInfo
from omnistage.protocol.errors import EngineError

if TYPE_CHECKING:
    from piper import PiperVoice

log = logging.getLogger(__name__)

# A loaded voice: cut at its decoder (``piper_stages``) where its graph allows.
Voice = Union["PiperVoice", StagedVoice]


@dataclass(frozen=True)
class VoiceSessions:
    """One voice, loaded: ``shared`` for any synthesis, ``wide`` (None: not loaded, as
    where it would have no more threads) for an answer's opening run alone."""

    shared: Voice
    wide: Voice | None = None

    def pick(self, alone: bool) -> Voice:
        return self.wide if alone and self.wide is not None else self.shared


def load_sessions(voice: VoiceInfo, threads: int, wide_threads: int) -> VoiceSessions:
    try:
        halves = cut(voice)  # once: both sessions run the same two halves
        shared = piper_voice(voice, threads, halves)
        wide = piper_voice(voice, wide_threads, halves) if wide_threads > threads else None
    except Exception as exc:
        raise EngineError(f"could not load voice {voice.id} ({voice.model_path}): {exc}") from exc
    return VoiceSessions(shared, wide)


def cut(voice: VoiceInfo) -> tuple[bytes, bytes, str] | None:
    """The voice's graph cut at its decoder (``piper_stages.split``); None: it runs whole."""
    try:
        return split(str(voice.model_path))
    except Exception as exc:  # an unreadable graph still runs whole, as Piper runs it
        log.warning("voice %s is not cut at its decoder (%s): it runs whole", voice.id, exc)
        return None


def piper_voice(voice: VoiceInfo, threads: int, halves: tuple[bytes, bytes, str] | None) -> Voice:
    """Piper's voice, run as the two ``halves`` of its graph (``cut``; None: whole), on
    ONNX sessions whose threads sleep when idle.

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

    def session(model: str | bytes) -> onnxruntime.InferenceSession:
        return onnxruntime.InferenceSession(
            model, sess_options=opts, providers=["CPUExecutionProvider"]
        )

    if halves is None:
        return PiperVoice(config=config, session=session(str(voice.model_path)))
    encoder, decoder = session(halves[0]), session(halves[1])
    return StagedVoice(PiperVoice(config=config, session=encoder), encoder, decoder, halves[2])


def synthesize_blocking(
    voice: Voice,
    text: str,
    length_scale: float,
    stop: threading.Event,
    noise: tuple[float | None, float | None] = (None, None),
    early: Callable[[bytes], None] | None = None,
) -> bytes:
    """``text``'s audio (pcm16), stopping at a sentence's end once ``stop`` is set. With
    ``early`` (an answer's opening), on a voice cut at its decoder: a first part of its
    first sentence may go to ``early`` as soon as it is made (``StagedVoice``), and the
    rest is returned."""
    from piper import SynthesisConfig

    # Relative to the voice's own pace (its config's length_scale, usually 1).
    config = SynthesisConfig(
        length_scale=length_scale * voice.config.length_scale,
        noise_scale=noise[0],
        noise_w_scale=noise[1],
    )
    parts: Iterable[bytes]
    if isinstance(voice, StagedVoice):
        parts = voice.synthesize(text, config, early)
    else:  # Piper yields one AudioChunk per sentence espeak finds in the text
        parts = (audio.audio_int16_bytes for audio in voice.synthesize(text, syn_config=config))
    pcm = bytearray()
    for part in parts:
        if stop.is_set():
            break
        pcm += part
    return bytes(pcm)
