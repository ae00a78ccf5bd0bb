"""A Responses API answer with audio, shaped from a thinker's and an audio stage's
chunks (``api.response_items.Output`` with ``api.response_audio.Spoken``)."""

from __future__ import annotations

import base64

import numpy as np

from omnistage.api.response_audio import AudioPlan, Spoken
from omnistage.api.response_items import Output
from omnistage.protocol.chunk_meta import AudioMeta
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.store.records import ResponseStatus
from tests.unit.fakes import chunk

THINKER, WAVE = 0, 2
RATE24 = AudioMeta(sample_rate=24000, format="pcm16")


def _pcm(n: int, seed: int) -> bytes:
    return (np.random.default_rng(seed).integers(-8000, 8000, n)).astype("<i2").tobytes()


def _answer(output: Output, *, reason: FinishReason = FinishReason.STOP) -> list[dict]:
    events = []
    events += output.add(chunk(THINKER, Modality.TEXT, "Hi"))
    events += output.add(chunk(WAVE, Modality.AUDIO, data=_pcm(480, 1), meta=RATE24))
    events += output.add(
        chunk(THINKER, Modality.TEXT, " there", finished=True, finish_reason=reason)
    )
    end = chunk(WAVE, Modality.AUDIO, data=_pcm(240, 2), finished=True, meta=RATE24)
    events += output.add(end)
    return events + output.finish()


def test_a_streamed_answer_sends_its_words_as_text_and_its_audio_as_deltas() -> None:
    output = Output("thinker", Spoken(AudioPlan(WAVE, "default", "pcm16", streamed=True)))
    events = _answer(output)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.audio.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    sound = b"".join(
        base64.b64decode(e["delta"]) for e in events if e["type"] == "response.audio.delta"
    )
    assert sound == _pcm(480, 1) + _pcm(240, 2)  # 24 kHz already: as the stage made it
    (item,) = (e["item"] for e in events if e["type"] == "response.output_item.done")
    assert item["content"][0]["text"] == "Hi there" and "audio" not in item["content"][0]
    assert item["status"] == ResponseStatus.COMPLETED


def test_a_whole_answer_carries_its_audio_file_and_the_thinker_says_how_it_ended() -> None:
    output = Output("thinker", Spoken(AudioPlan(WAVE, "default", "wav", streamed=False)))
    events = _answer(output, reason=FinishReason.LENGTH)
    assert not [e for e in events if e["type"] == "response.audio.delta"]
    (part,) = output.items[0].item()["content"]
    wav = base64.b64decode(part["audio"]["data"])
    assert part["audio"]["format"] == "wav" and wav[:4] == b"RIFF"
    assert len(wav) == 44 + (480 + 240) * 2
    # The audio stage's own end (a STOP) does not hide the thinker's LENGTH.
    assert output.items[0].status == ResponseStatus.INCOMPLETE
