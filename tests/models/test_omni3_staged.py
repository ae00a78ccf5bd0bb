"""Qwen3-Omni (MoE) served as a staged pipeline (thinker -> talker with its code predictor
-> code2wav, each stage its own replica process, picked by the checkpoint itself) answers
exactly what transformers' monolithic ``Qwen3OmniMoeForConditionalGeneration.generate``
answers on the same tiny random-weight checkpoint: the same text, the same codes, and so
the same waveform, sample for sample after int16 rounding; for text, spoken and image
questions (the reference's prompt made by transformers' own processor).

Greedy decoding in thinker and talker, one thread everywhere, one request at a time:
random tiny weights have flat logits, so any change of summation order could flip a token.
The code2wav stage decodes in chunks of 8 codes here, so the audio comes in several
chunks; the reference decodes the same codes in the same chunks.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integration.harness import HeadProc
from tests.omni3_tiny import SAMPLES_PER_CODE, build_tiny_omni3, special_id
from tests.omni_tiny import (
    mp4,
    one_thread_head,
    png,
    spoken_answer,
    spoken_chat,
    spoken_deltas,
    tone_wav,
    video_question,
)
from tests.video_reference import audio_in_video_layout

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


# The media tokens the real tokenizer's config names (the processor reads them there).
MEDIA_TOKENS = {
    "audio_token": "<|audio_pad|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
}


def _processor(directory: Path) -> Any:
    """transformers' ``Qwen3OmniMoeProcessor`` for the checkpoint: the prompt's ids, audio
    features and pixels the staged thinker must make alike. Built by hand: its constructor
    insists on a video processor, which needs torchvision (not installed: videos are
    prepared by video_in.py, checked against transformers in tests/unit/test_video_in.py)."""
    from transformers import (
        AutoImageProcessor,
        AutoTokenizer,
        Qwen3OmniMoeProcessor,
        WhisperFeatureExtractor,
    )

    processor = object.__new__(Qwen3OmniMoeProcessor)
    processor.tokenizer = AutoTokenizer.from_pretrained(directory)
    processor.image_processor = AutoImageProcessor.from_pretrained(directory)
    processor.feature_extractor = WhisperFeatureExtractor.from_pretrained(directory)
    processor.video_processor = processor.chat_template = None
    for name, token in MEDIA_TOKENS.items():
        setattr(processor, name, token)
        setattr(processor, f"{name}_id", special_id(token))
    return processor


def reference(
    directory: Path,
    messages: list[dict[str, str]],
    voice: str | None,
    wav: bytes | None = None,
    images: list[bytes] | None = None,
    videos: list[bytes] | None = None,
    sound: bool = False,
) -> tuple[str, bytes]:
    """The monolithic model's answer: its text, and its waveform as int16 PCM, decoded
    from its codes in the staged pipeline's chunks (no ``voice``: its text alone). A
    spoken input (``wav``) and images go through the processor, videos through
    video_in.py (the processor's video path needs torchvision), their placeholders
    before the last message's text, as the model's chat template puts them; a video's
    audio is heard only with ``sound`` (see ``_tracks``)."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omnistage.engines.omni import audio_in, video_in, vision_in
    from omnistage.engines.omni.token2wav import pcm16
    from omnistage.protocol.messages import Prompt

    torch.set_num_threads(1)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(directory).eval()
    processor = _processor(directory)
    heard = [audio_in.samples(Prompt(audio=wav, audio_format="wav"))] if wav else None
    media = "<|audio_start|><|audio_pad|><|audio_end|>" if wav else ""
    media += "<|vision_start|><|image_pad|><|vision_end|>" * len(images or [])
    watched = None
    if videos:
        settings = video_in.VideoSettings.of(processor.image_processor)
        watched = video_in.prepare(settings, videos)
        watched.marks = video_in.QWEN3_MARKS
        media += watched.placeholder()  # expanded already: the processor must not count it
        processor.video_token = processor.video_token_id = None
    tracks = _tracks(model, processor, watched, videos) if sound else None
    if tracks is not None:
        assert watched is not None and wav is None  # the processor must not count these
        media = media.removesuffix(watched.placeholder()) + tracks.pop("layout")
        processor.audio_token = processor.audio_token_id = None
    messages = [*messages[:-1], {**messages[-1], "content": media + messages[-1]["content"]}]
    text = processor.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    seen = vision_in.decoded(images) if images else None
    inputs = processor(text=text, audio=heard, images=seen, return_tensors="pt")
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask")
    if watched is not None:
        inputs.update(
            pixel_values_videos=watched.pixels,
            video_grid_thw=watched.grid,
            video_second_per_grid=watched.seconds,
        )
    inputs.update(tracks or {})
    decode = model.code2wav.chunked_decode
    model.code2wav.chunked_decode = lambda codes, **_: decode(codes, CHUNK, CONTEXT)
    thinker = {
        "use_audio_in_video": sound,
        "thinker_max_new_tokens": MAX_TOKENS,
        "thinker_do_sample": False,
        "thinker_eos_token_id": special_id("<|im_end|>"),
    }
    if voice is None:  # words only: the thinker's answer
        sequences = model.generate(ids, **inputs, **thinker, return_audio=False)
        answer = processor.tokenizer.decode(sequences[0, ids.shape[1] :], skip_special_tokens=True)
        return answer, b""
    sequences, wav_out = model.generate(
        ids,
        **inputs,
        **thinker,
        speaker=voice,
        talker_do_sample=False,
        talker_max_new_tokens=MAX_CODES,
    )
    answer = processor.tokenizer.decode(sequences[0, ids.shape[1] :], skip_special_tokens=True)
    return answer, pcm16(wav_out.reshape(-1))


def _tracks(model: Any, processor: Any, watched: Any, videos: list[bytes]) -> dict[str, Any]:
    """The videos' audio tracks as the monolithic model takes them: decoded as a spoken
    input is, the processor's features (audio_in.prepare_qwen3, checked against it by
    the spoken question's test), and the videos' placeholders with the tracks' tokens
    merged in by the processor's own code (``audio_in_video_layout``), at the thinker
    rope's time scale."""
    import torch
    from faster_whisper.audio import decode_audio

    from omnistage.engines.omni import audio_in

    config = model.config.thinker_config
    window, per_second = config.audio_config.n_window, config.position_id_per_seconds
    extractor = processor.feature_extractor
    heard = [audio_in.prepare_qwen3(extractor, decode_audio(io.BytesIO(v)), window) for v in videos]
    seconds = watched.seconds.tolist()
    layout = "".join(
        audio_in_video_layout(grid, seconds[i], heard[i].tokens, "qwen3_omni_moe", per_second)
        for i, grid in enumerate(watched.grid.tolist())
    )
    return {
        "layout": layout,
        "input_features": torch.cat([a.features for a in heard]),
        "feature_attention_mask": torch.cat([a.mask for a in heard]),
    }


def _chat(head: HeadProc, messages: list[dict[str, Any]], voice: str) -> tuple[str, bytes]:
    text, pcm, _ = spoken_answer(head, messages, voice, MAX_TOKENS)
    return text, pcm


def test_staged_omni3_answers_as_the_monolithic_model(
    omni3_head: HeadProc, omni3_dir: Path
) -> None:
    messages = [{"role": "user", "content": "Say something about the sea."}]
    want_text, want_pcm = reference(omni3_dir, messages, "Chelsie")

    text, pcm = _chat(omni3_head, messages, "Chelsie")

    assert text == want_text
    # A frame per talker step but the last (its residual codes are never drawn), each
    # code SAMPLES_PER_CODE samples, less what the causal upsampling holds back per chunk.
    assert MAX_CODES * SAMPLES_PER_CODE * 2 * 0.8 < len(want_pcm) < MAX_CODES * SAMPLES_PER_CODE * 2
    assert np.abs(np.frombuffer(want_pcm, "<i2")).mean() > 100  # not near silence
    assert pcm == want_pcm


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


def test_a_spoken_question_is_answered_as_the_monolithic_model(
    omni3_head: HeadProc, omni3_dir: Path
) -> None:
    wav = tone_wav(1.3)  # more than one of the audio tower's windows (100 frames, 1 s)
    question = "What is this sound?"
    want = reference(omni3_dir, [{"role": "user", "content": question}], "Ethan", wav=wav)

    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode()}}
    part["input_audio"]["format"] = "wav"
    content = [{"type": "text", "text": question}, part]

    assert _chat(omni3_head, [{"role": "user", "content": content}], "Ethan") == want


def test_a_question_about_images_is_answered_as_the_monolithic_model(
    omni3_head: HeadProc, omni3_dir: Path
) -> None:
    images = [png(84, 56), png(64, 64, seed=1)]  # 6 image tokens, and 4
    question = "What is in these pictures?"
    want = reference(omni3_dir, [{"role": "user", "content": question}], "Chelsie", images=images)

    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}}
        for b64 in (base64.b64encode(image).decode() for image in images)
    ]
    content.append({"type": "text", "text": question})

    assert _chat(omni3_head, [{"role": "user", "content": content}], "Chelsie") == want


def test_a_question_about_a_video_is_answered_as_the_monolithic_model(
    omni3_head: HeadProc, omni3_dir: Path
) -> None:
    clip = mp4()  # 4 frames at 2 a second: 2 temporal patches of 12 x 12 tokens
    question = "What happens in this video?"
    want = reference(omni3_dir, [{"role": "user", "content": question}], "Chelsie", videos=[clip])

    asked = video_question(clip, question)
    text, pcm, prompt_tokens = spoken_answer(omni3_head, asked, "Chelsie", MAX_TOKENS)

    assert prompt_tokens > 2 * 12 * 12  # the video's tokens are in it
    assert (text, pcm) == want


def test_a_videos_own_audio_is_heard_as_the_monolithic_model_hears_it(
    omni3_head: HeadProc, omni3_dir: Path
) -> None:
    """``use_audio_in_video``: the track's tokens merge with the frames' by time, and the
    thinker's rope reads that layout, as transformers' generate lays it out. In words
    only: transformers' own talker fails on such a prompt, so a spoken answer is a 400."""
    clip = mp4(frames=8, sound=True)  # 4 temporal patches of 12 x 12 tokens, and 4 s of tone
    question = "What do you hear in this video?"
    messages = [{"role": "user", "content": question}]
    want_text, _ = reference(omni3_dir, messages, None, videos=[clip], sound=True)
    deaf_text, _ = reference(omni3_dir, messages, None, videos=[clip])

    body = {
        "model": omni3_head.client.get("/v1/models").json()["data"][0]["id"],
        "messages": video_question(clip, question),
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "mm_processor_kwargs": {"use_audio_in_video": True},
    }
    answer = omni3_head.client.post("/v1/chat/completions", json=body, timeout=120)
    spoken = {**body, "modalities": ["text", "audio"], "audio": {"format": "pcm16"}}
    refused = omni3_head.client.post("/v1/chat/completions", json=spoken, timeout=120)

    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] > 4 * 144 + 2  # the frames, the track
    assert answer.json()["choices"][0]["message"]["content"] == want_text
    assert want_text != deaf_text  # the track was heard
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "mm_processor_kwargs.use_audio_in_video"


def test_the_checkpoint_picks_its_stage_graph(omni3_head: HeadProc) -> None:
    stages = {s["stage_id"]: s for s in omni3_head.stages()["stages"]}
    assert [stages[i]["name"] for i in sorted(stages)] == ["thinker", "talker", "code2wav"]
