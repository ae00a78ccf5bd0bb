"""Qwen3-Omni (MoE) served as a staged pipeline (thinker -> talker with its code predictor
-> code2wav, each stage its own replica process, picked by the checkpoint itself) answers
exactly what transformers' monolithic ``Qwen3OmniMoeForConditionalGeneration.generate``
answers on the same tiny random-weight checkpoint: the same text, the same codes, and so
the same waveform, sample for sample after int16 rounding.

Greedy decoding in thinker and talker, one thread everywhere, one request at a time:
random tiny weights have flat logits, so any change of summation order could flip a token.
The code2wav stage decodes in chunks of 8 codes here, so the audio comes in several
chunks; the reference decodes the same codes in the same chunks.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.integration.harness import HeadProc
from tests.omni3_tiny import SAMPLES_PER_CODE, build_tiny_omni3, special_id
from tests.omni_tiny import one_thread_head, spoken_chat, spoken_deltas

# The first test also waits for the head and its three replicas to load.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

MAX_TOKENS = 6  # the thinker's answer
MAX_CODES = 24  # the talker's steps (random weights never say end-of-speech early)
CHUNK, CONTEXT = 8, 4  # code2wav's chunks: codes decoded at a time, codes of context


@pytest.fixture(scope="module")
def omni3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_omni3(tmp_path_factory.mktemp("omni3") / "qwen3-omni-tiny")


@pytest.fixture(scope="module")
def omni3_head(omni3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HeadProc]:
    overrides = {
        "1": {"engine_args": {"do_sample": False, "max_new_tokens": MAX_CODES}},
        "2": {"engine_args": {"chunk_codes": CHUNK, "left_context_codes": CONTEXT}},
    }
    head = one_thread_head(tmp_path_factory.mktemp("omni3-head"), omni3_dir, overrides, "omni3")
    try:
        yield head
    finally:
        head.stop()


def reference(directory: Path, messages: list[dict[str, str]], voice: str) -> tuple[str, bytes]:
    """The monolithic model's answer: its text, and its waveform as int16 PCM, decoded
    from its codes in the staged pipeline's chunks."""
    import torch
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    from omnistage.engines.omni.token2wav import pcm16

    torch.set_num_threads(1)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    decode = model.code2wav.chunked_decode
    model.code2wav.chunked_decode = lambda codes, **_: decode(codes, CHUNK, CONTEXT)
    sequences, wav = model.generate(
        torch.tensor([ids]),
        speaker=voice,
        thinker_max_new_tokens=MAX_TOKENS,
        thinker_do_sample=False,
        thinker_eos_token_id=special_id("<|im_end|>"),
        talker_do_sample=False,
        talker_max_new_tokens=MAX_CODES,
    )
    text = tokenizer.decode(sequences[0, len(ids) :], skip_special_tokens=True)
    return text, pcm16(wav.reshape(-1))


def test_staged_omni3_answers_as_the_monolithic_model(
    omni3_head: HeadProc, omni3_dir: Path
) -> None:
    messages = [{"role": "user", "content": "Say something about the sea."}]
    want_text, want_pcm = reference(omni3_dir, messages, "Chelsie")

    body = spoken_chat(omni3_head, messages, "Chelsie", MAX_TOKENS)
    response = omni3_head.client.post("/v1/chat/completions", json=body, timeout=120)

    assert response.status_code == 200, response.text
    audio = response.json()["choices"][0]["message"]["audio"]
    assert audio["transcript"] == want_text
    # A frame per talker step but the last (its residual codes are never drawn), each
    # code SAMPLES_PER_CODE samples, less what the causal upsampling holds back per chunk.
    assert MAX_CODES * SAMPLES_PER_CODE * 2 * 0.8 < len(want_pcm) < MAX_CODES * SAMPLES_PER_CODE * 2
    assert np.abs(np.frombuffer(want_pcm, "<i2")).mean() > 100  # not near silence
    assert base64.b64decode(audio["data"]) == want_pcm


def test_the_streamed_answer_is_the_same_in_several_audio_chunks(
    omni3_head: HeadProc, omni3_dir: Path
) -> None:
    messages = [{"role": "user", "content": "And the mountains?"}]
    want_text, want_pcm = reference(omni3_dir, messages, "Ethan")

    body = {**spoken_chat(omni3_head, messages, "Ethan", MAX_TOKENS), "stream": True}
    pieces = list(spoken_deltas(omni3_head, body, timeout=120))

    assert "".join(words for words, _ in pieces) == want_text
    audio = [sound for _, sound in pieces if sound]
    assert b"".join(audio) == want_pcm
    assert len(audio) >= MAX_CODES // CHUNK


def test_the_checkpoint_picks_its_stage_graph(omni3_head: HeadProc) -> None:
    stages = {s["stage_id"]: s for s in omni3_head.stages()["stages"]}
    assert [stages[i]["name"] for i in sorted(stages)] == ["thinker", "talker", "code2wav"]
