"""semantic_vad with the real Smart Turn v3 model on Piper speech: slow tests.

The paused clip is a spoken sentence with 700 ms of silence spliced in at a word boundary
(found as the quietest point near where the first words, said alone, end), as a speaker
who stops to think mid-sentence; it is fed as a microphone sends it, in 20 ms chunks.
"""

from __future__ import annotations

import numpy as np
import pytest

from omnistage.audio import smart_turn
from omnistage.audio.semantic_vad import CHECK_MS, SemanticVadParams
from omnistage.audio.server_vad import SpeechStarted, SpeechStopped
from omnistage.audio.vad import VadStream
from tests.models.test_vad import CHUNK, RATE, loud_span_ms, silence, speech
from tests.splice import cut_point

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not smart_turn.available(), reason=smart_turn.INSTALL),
]

QUESTION = "What is the capital of France?"
FIRST, REST = "Can you tell me what the weather", "will be like in Paris tomorrow?"


def feed(audio: np.ndarray) -> tuple[list, VadStream]:
    stream = VadStream(SemanticVadParams(), sample_rate=RATE)
    data = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
    events = []
    for i in range(0, len(data), CHUNK):
        events += stream.feed(data[i : i + CHUNK])
    return events, stream


def spliced(first: str, rest: str, pause_s: float) -> tuple[np.ndarray, np.ndarray]:
    """``first rest`` said as one sentence, cut where ``first`` ends: the two halves."""
    whole = speech(f"{first} {rest}")
    alone = speech(first)
    loud = np.flatnonzero(np.abs(alone) > 0.02)
    cut = cut_point(alone[loud[0] : loud[-1] + 1], whole, RATE)
    return whole[:cut], np.concatenate([silence(pause_s), whole[cut:]])


def test_features_are_whispers_as_transformers_computes_them() -> None:
    from transformers import WhisperFeatureExtractor

    audio = np.concatenate([silence(3.0), speech(QUESTION)])[::3][-smart_turn.SAMPLES :]
    audio = np.pad(audio, (smart_turn.SAMPLES - len(audio), 0))
    reference = WhisperFeatureExtractor(chunk_length=8)(
        audio, sampling_rate=16_000, do_normalize=True, return_tensors="np"
    ).input_features[0]
    np.testing.assert_allclose(smart_turn.log_mel(audio), reference, atol=1e-4)


def test_a_finished_question_ends_the_turn_soon_after_its_last_word() -> None:
    said = speech(QUESTION)
    _, last = loud_span_ms(said, 0.5)
    events, stream = feed(np.concatenate([silence(0.5), said, silence(5.0)]))
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped]
    # The turn ends where the silence began (Silero's windows lag the words a little)...
    assert last - 100 <= events[1].audio_end_ms <= last + 200
    # ... on the model's word, as soon as it was asked: CHECK_MS into the silence.
    verdict = stream.detector.last_verdict
    assert verdict is not None and verdict[0] >= SemanticVadParams().threshold
    assert verdict[1] - events[1].audio_end_ms <= CHECK_MS + 32


def test_a_pause_mid_sentence_does_not_end_the_turn() -> None:
    head, tail = spliced(FIRST, REST, 0.7)
    pause_from = 500 + len(head) * 1000 / RATE
    events, _ = feed(np.concatenate([silence(0.5), head, tail, silence(5.0)]))
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped], events
    assert events[1].audio_end_ms > pause_from + 700  # after the rest of the sentence
