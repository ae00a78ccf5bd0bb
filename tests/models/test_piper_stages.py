"""The default voice cut at its decoder (piper_stages): the same audio, its opening sooner."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from omnistage.engines.speech import piper_stages
from omnistage.engines.speech.piper_sessions import cut, piper_voice, synthesize_blocking
from omnistage.engines.speech.piper_stages import FIRST_FRAMES, KNEE, StagedVoice
from omnistage.engines.speech.voices import VoiceCatalog

pytestmark = pytest.mark.slow

QUIET = (0.0, 0.0)  # no noise: a text is said the same way every time
DECODE_PER_ENCODE = piper_stages.DECODE_PER_ENCODE


@pytest.fixture(autouse=True)
def always_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """An opening long enough is cut however fast this machine makes its frames: the
    rule that reckons whether its rest is in time has a test of its own, below."""
    monkeypatch.setattr(piper_stages, "DECODE_PER_ENCODE", 0.0)


@pytest.fixture(scope="module")
def voices():
    """The default voice as the talker loads it (cut) and as Piper runs it (whole)."""
    from piper import PiperVoice

    info = VoiceCatalog.discover(None, None, None).default
    staged = piper_voice(info, 1, cut(info))
    whole = PiperVoice.load(str(info.model_path), str(info.config_path))
    return staged, whole


def said(voice, text: str, early=None) -> np.ndarray:
    pcm = synthesize_blocking(voice, text, 1.0, threading.Event(), QUIET, early)
    return np.frombuffer(pcm, dtype=np.int16).astype(np.float64)


def test_the_default_voice_is_cut_and_says_a_text_as_piper_does_whole(voices):
    staged, whole = voices
    assert isinstance(staged, StagedVoice)
    text = "The capital of France is Paris. It lies on the Seine."
    got, ref = said(staged, text), said(whole, text)
    # The same audio, but for a sample's rounding (float32 steps in another order).
    assert len(got) == len(ref) and np.abs(got - ref).max() <= 1


def test_an_openings_first_part_comes_first_and_the_parts_make_the_sentence(voices):
    staged, whole = voices
    hop = staged.config.hop_length
    # Its first 24 frames hold the sentence's peak: the same audio, to a sample's rounding.
    head: list[bytes] = []
    rest = said(staged, "Water boils at one hundred degrees", head.append)
    ref = said(whole, "Water boils at one hundred degrees")
    assert len(head) == 1 and len(head[0]) == FIRST_FRAMES * hop * 2
    got = np.concatenate([np.frombuffer(head[0], dtype=np.int16), rest])
    assert len(got) == len(ref) and np.abs(got - ref).max() <= 1
    # Its peak comes later: scaled by the first part's peak, louder than Piper's, the
    # rest's loudest samples bent below full scale, otherwise the same audio.
    head.clear()
    rest = said(staged, "Sure, I can help", head.append)
    ref = said(whole, "Sure, I can help")
    got = np.concatenate([np.frombuffer(head[0], dtype=np.int16), rest])
    gain = float(np.dot(got, ref) / np.dot(ref, ref))
    assert len(got) == len(ref) and 1.05 < gain < 1.6
    assert KNEE * 32767 < np.abs(rest).max() < 32767
    error = ((got - gain * ref) ** 2).sum()
    assert 10 * np.log10(gain * gain * (ref**2).sum() / error) > 25


def test_a_short_opening_is_not_cut(voices):
    staged, _ = voices
    head: list[bytes] = []
    assert len(said(staged, "Hi.", head.append)) > 0 and head == []


def test_on_busy_cores_an_opening_is_not_cut_where_its_rest_would_come_late(
    voices, monkeypatch: pytest.MonkeyPatch
):
    """The frames took long (a fake clock says 0.5 s): the rest's decoding would take
    longer than the first part plays, so the sentence goes whole, with no gap in it."""
    monkeypatch.setattr(piper_stages, "DECODE_PER_ENCODE", DECODE_PER_ENCODE)
    staged, _ = voices
    ticks = iter([0.0, 0.5])
    slow = StagedVoice(
        staged.piper, staged._encoder, staged._decoder, staged._frames, lambda: next(ticks)
    )
    head: list[bytes] = []
    assert len(said(slow, "Water boils at one hundred degrees", head.append)) and head == []
    # At the frames' usual speed the same sentence is cut; too short a one never is.
    assert staged.in_time(192, 0.01) and not staged.in_time(192, 0.5)
    assert not staged.in_time(48, 0.0)
