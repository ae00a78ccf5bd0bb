"""Qwen2.5-Omni served as a staged pipeline (thinker -> talker -> token2wav, each stage
its own replica process, picked by the checkpoint itself) answers exactly what
transformers' monolithic ``Qwen2_5OmniForConditionalGeneration.generate`` answers on the
same tiny random-weight checkpoint: the same text, and from the same codes and the same
DiT noise (both seeded alike) the same waveform, sample for sample after int16 rounding.

Greedy decoding in thinker and talker, one thread everywhere, one request at a time:
random tiny weights have flat logits, so any change of summation order could flip a token.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import HeadProc
from tests.omni_tiny import CODEC_EOS, build_tiny_omni, spoken_deltas

pytestmark = pytest.mark.slow

MAX_TOKENS = 6  # the thinker's answer
MAX_CODES = 24  # the talker's codes (random weights never say end-of-speech early)
NOISE_SEED = 0  # the token2wav stage's default noise_seed


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_omni(tmp_path_factory.mktemp("omni") / "qwen2.5-omni-tiny")


@pytest.fixture(scope="module")
def omni_head(omni_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HeadProc]:
    overrides = {"1": {"engine_args": {"do_sample": False, "max_new_tokens": MAX_CODES}}}
    mp = pytest.MonkeyPatch()
    mp.setenv("OMP_NUM_THREADS", "1")  # the replicas inherit it
    head = HeadProc(
        tmp_path_factory.mktemp("omni-head"),
        str(omni_dir),
        "--stage-overrides",
        json.dumps(overrides),
        name="omni-head",
    )
    mp.undo()
    try:
        head.wait_healthy(timeout=240)
        yield head
    finally:
        head.stop()


def reference(
    directory: Path, messages: list[dict[str, str]], voice: str, wav: bytes | None = None
) -> tuple[str, bytes]:
    """The monolithic model's answer: its text and its waveform as int16 PCM. A spoken
    input (``wav``) is prepared as Qwen2.5-Omni's processor prepares it."""
    import torch
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    from omnistage.engines.omni import audio_in
    from omnistage.engines.omni.token2wav import pcm16
    from omnistage.protocol.messages import Prompt

    torch.set_num_threads(1)
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    heard: dict[str, Any] = {}
    if wav is not None:
        spoken = audio_in.samples(Prompt(audio=wav, audio_format="wav"))
        prepared = audio_in.prepare(audio_in.load_extractor(str(directory)), spoken)
        text = prepared.placeholder() + messages[-1]["content"]
        messages = [*messages[:-1], {**messages[-1], "content": text}]
        heard = {"input_features": prepared.features, "feature_attention_mask": prepared.mask}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    torch.manual_seed(NOISE_SEED)  # greedy stages draw nothing: the DiT's noise is the first draw
    sequences, wav_out = model.generate(
        torch.tensor([ids]),
        **heard,
        speaker=voice,
        thinker_max_new_tokens=MAX_TOKENS,
        thinker_do_sample=False,
        talker_do_sample=False,
        talker_max_new_tokens=MAX_CODES,
        talker_eos_token_id=[CODEC_EOS],
    )
    text = tokenizer.decode(sequences[0, len(ids) :], skip_special_tokens=True)
    return text, pcm16(wav_out)


def _body(head: HeadProc, messages: list[dict[str, Any]], voice: str) -> dict[str, Any]:
    return {
        "model": head.client.get("/v1/models").json()["data"][0]["id"],
        "messages": messages,
        "modalities": ["text", "audio"],
        "audio": {"voice": voice, "format": "pcm16"},
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }


def _chat(head: HeadProc, messages: list[dict[str, Any]], voice: str) -> tuple[str, bytes]:
    body = _body(head, messages, voice)
    response = head.client.post("/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    return message["audio"]["transcript"], base64.b64decode(message["audio"]["data"])


def _chat_streamed(
    head: HeadProc, messages: list[dict[str, str]], voice: str
) -> tuple[str, bytes, int]:
    """The streamed answer's transcript, its audio, and how many audio deltas it came in."""
    body = {**_body(head, messages, voice), "stream": True}
    text, audio = [], []
    for words, sound in spoken_deltas(head, body, timeout=120):
        text.append(words)
        if sound:
            audio.append(sound)
    return "".join(text), b"".join(audio), len(audio)


@pytest.mark.parametrize("voice", ["Chelsie", "Ethan"])
def test_staged_omni_answers_as_the_monolithic_model(
    omni_head: HeadProc, omni_dir: Path, voice: str
) -> None:
    messages = [{"role": "user", "content": "Say something about the sea."}]
    want_text, want_pcm = reference(omni_dir, messages, voice)

    text, pcm = _chat(omni_head, messages, voice)

    assert text == want_text
    assert len(want_pcm) == MAX_CODES * 2 * 16 * 2  # codes x DiT repeats x BigVGAN x bytes
    assert pcm == want_pcm


def test_the_streamed_answer_is_the_same(omni_head: HeadProc, omni_dir: Path) -> None:
    messages = [{"role": "user", "content": "And the mountains?"}]
    want_text, want_pcm = reference(omni_dir, messages, "Chelsie")

    text, pcm, _ = _chat_streamed(omni_head, messages, "Chelsie")

    assert text == want_text
    assert pcm == want_pcm


def test_the_checkpoint_picks_its_stage_graph(omni_head: HeadProc) -> None:
    stages = {s["stage_id"]: s for s in omni_head.stages()["stages"]}
    assert [stages[i]["name"] for i in sorted(stages)] == ["thinker", "talker", "token2wav"]
    assert all(len(omni_head.up_replicas(i)) == 1 for i in stages)
    # dtype "auto" on the CPU is float32, as the monolithic model loads.
    kernels = [r["kernel"] for i in sorted(stages) for r in omni_head.up_replicas(i)]
    assert kernels == ["cpu float32"] * 3


def test_a_text_chat_runs_the_thinker_alone(omni_head: HeadProc, omni_dir: Path) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    want_text, _ = reference(omni_dir, messages, "Chelsie")
    model = omni_head.client.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}
    response = omni_head.client.post("/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == want_text


def _tone_wav(seconds: float = 0.5, rate: int = 16_000) -> bytes:
    """A WAV file of a 440 Hz tone."""
    import io
    import wave

    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return out.getvalue()


def test_a_spoken_question_is_answered_as_the_monolithic_model(
    omni_head: HeadProc, omni_dir: Path
) -> None:
    wav = _tone_wav()
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode()}}
    part["input_audio"]["format"] = "wav"
    question = "What is this sound?"
    want_text, want_pcm = reference(
        omni_dir, [{"role": "user", "content": question}], "Chelsie", wav
    )

    content = [{"type": "text", "text": question}, part]
    text, pcm = _chat(omni_head, [{"role": "user", "content": content}], "Chelsie")

    assert text == want_text
    assert pcm == want_pcm


def test_an_unknown_voice_is_a_400_naming_the_voices(omni_head: HeadProc) -> None:
    model = omni_head.client.get("/v1/models").json()["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hi"}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "nobody", "format": "pcm16"},
        "max_tokens": 2,
    }
    response = omni_head.client.post("/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "Chelsie" in response.json()["error"]["message"]
