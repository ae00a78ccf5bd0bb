"""Qwen2.5-Omni served as a staged pipeline (thinker -> talker -> token2wav, each stage
its own replica process, two for the talker, picked by the checkpoint itself) answers
exactly what
transformers' monolithic ``Qwen2_5OmniForConditionalGeneration.generate`` answers on the
same tiny random-weight checkpoint: the same text, and from the same codes and the same
DiT noise (both seeded alike) the same waveform, sample for sample after int16 rounding.

Greedy decoding in thinker and talker, one thread everywhere, one request at a time:
random tiny weights have flat logits, so any change of summation order could flip a token.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import HeadProc
from tests.omni_tiny import (
    CODEC_EOS,
    OMNI_MAX_CODES,
    mp4,
    png,
    served,
    spoken_answer,
    spoken_chat,
    spoken_deltas,
    tone_wav,
    video_question,
)
from tests.video_reference import audio_in_video_layout

# The first test also waits for the head and its four replicas to load.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

MAX_TOKENS = 6  # the thinker's answer
NOISE_SEED = 0  # the token2wav stage's default noise_seed


def _prepared(
    directory: Path,
    messages: list[dict[str, str]],
    wav: bytes | None,
    images: list[bytes] | None,
    videos: list[bytes] | None,
    sound: bool,
) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """The messages with the media's placeholders before the last one's text, and the
    model's inputs for the media: a spoken input (``wav``), images and videos prepared as
    Qwen2.5-Omni's processor prepares them (video_in.py is checked against it in
    tests/unit/test_video_in.py); with ``sound`` the videos' audio tracks too, decoded as
    a spoken input is and laid out with the frames by the processor's own code
    (``audio_in_video_layout``)."""
    import torch
    from faster_whisper.audio import decode_audio

    from omnistage.engines.omni import audio_in, video_in, vision_in
    from omnistage.protocol.messages import Prompt

    extractor = audio_in.load_extractor(str(directory))
    placeholders, heard, audio = [], {}, []
    if wav is not None:
        spoken = audio_in.prepare(
            extractor, audio_in.samples(Prompt(audio=wav, audio_format="wav"))
        )
        placeholders.append(spoken.placeholder())
        audio.append(spoken)
    if images:
        seen = vision_in.prepare(vision_in.load_processor(str(directory)), images)
        placeholders.append(seen.placeholder())
        # By the thinker's prefix: the talker, which generate hands every unprefixed
        # argument too, refuses pixel values (transformers 5.25); the grids go to both.
        heard.update(thinker_pixel_values=seen.pixels, image_grid_thw=seen.grid)
    if videos:
        settings = video_in.VideoSettings.of(vision_in.load_processor(str(directory)))
        watched = video_in.prepare(settings, videos)
        placeholders.append(watched.placeholder())
        heard.update(
            thinker_pixel_values_videos=watched.pixels,
            video_grid_thw=watched.grid,
            video_second_per_grid=watched.seconds,
        )
    if videos and sound:
        tracks = [audio_in.prepare(extractor, decode_audio(io.BytesIO(v))) for v in videos]
        seconds = watched.seconds.tolist()
        placeholders[-1] = "".join(
            audio_in_video_layout(grid, seconds[i], tracks[i].tokens)
            for i, grid in enumerate(watched.grid.tolist())
        )
        audio += tracks
    if audio:
        heard["input_features"] = torch.cat([a.features for a in audio])
        heard["feature_attention_mask"] = torch.cat([a.mask for a in audio])
    text = "".join(placeholders) + messages[-1]["content"]
    return [*messages[:-1], {**messages[-1], "content": text}], heard


def reference(
    directory: Path,
    messages: list[dict[str, str]],
    voice: str,
    wav: bytes | None = None,
    images: list[bytes] | None = None,
    videos: list[bytes] | None = None,
    sound: bool = False,
) -> tuple[str, bytes]:
    """The monolithic model's answer: its text and its waveform as int16 PCM, to the
    messages with a spoken input (``wav``), images and videos (see ``_prepared``); a
    video's audio track is heard only with ``sound`` (``use_audio_in_video``)."""
    import torch
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    from omnistage.engines.omni.token2wav import pcm16

    torch.set_num_threads(1)
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    messages, heard = _prepared(directory, messages, wav, images, videos, sound)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    torch.manual_seed(NOISE_SEED)  # greedy stages draw nothing: the DiT's noise is the first draw
    sequences, wav_out = model.generate(
        torch.tensor([ids]),
        **heard,
        speaker=voice,
        use_audio_in_video=sound,
        thinker_max_new_tokens=MAX_TOKENS,
        thinker_do_sample=False,
        talker_do_sample=False,
        talker_max_new_tokens=OMNI_MAX_CODES,
        talker_eos_token_id=[CODEC_EOS],
    )
    text = tokenizer.decode(sequences[0, len(ids) :], skip_special_tokens=True)
    return text, pcm16(wav_out)


def _chat(head: HeadProc, messages: list[dict[str, Any]], voice: str) -> tuple[str, bytes]:
    text, pcm, _ = spoken_answer(head, messages, voice, MAX_TOKENS)
    return text, pcm


def _chat_streamed(
    head: HeadProc, messages: list[dict[str, str]], voice: str
) -> tuple[str, bytes, int]:
    """The streamed answer's transcript, its audio, and how many audio deltas it came in."""
    body = {**spoken_chat(head, messages, voice, MAX_TOKENS), "stream": True}
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
    assert len(want_pcm) == OMNI_MAX_CODES * 2 * 16 * 2  # codes x DiT repeats x BigVGAN x bytes
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
    omni_head.wait_up(1, 2, timeout=240)
    assert [len(omni_head.up_replicas(i)) for i in sorted(stages)] == [1, 2, 1]
    # dtype "auto" on the CPU is float32, as the monolithic model loads.
    kernels = [r["kernel"] for i in sorted(stages) for r in omni_head.up_replicas(i)]
    assert kernels == ["cpu float32"] * 4


def test_each_of_two_talker_replicas_answers_as_the_monolithic_model(
    omni_head: HeadProc, omni_dir: Path
) -> None:
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    want_text, want_pcm = reference(omni_dir, messages, "Ethan")
    omni_head.wait_up(1, 2, timeout=240)
    before = {r["replica_id"]: r["dispatched_total"] for r in omni_head.up_replicas(1)}

    for _ in range(2):  # the talker's replicas are taken in turn (round-robin)
        text, pcm = _chat(omni_head, messages, "Ethan")
        assert text == want_text
        assert pcm == want_pcm

    after = {r["replica_id"]: r["dispatched_total"] for r in omni_head.up_replicas(1)}
    assert {rid: after[rid] - before[rid] for rid in after} == {rid: 1 for rid in after}


def test_a_text_chat_runs_the_thinker_alone(omni_head: HeadProc, omni_dir: Path) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    want_text, _ = reference(omni_dir, messages, "Chelsie")
    model = omni_head.client.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}
    response = omni_head.client.post("/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == want_text


def test_a_spoken_question_is_answered_as_the_monolithic_model(
    omni_head: HeadProc, omni_dir: Path
) -> None:
    wav = tone_wav()
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


PICTURE = png(56, 56, seed=1)


@pytest.fixture(scope="module")
def picture_url() -> Iterator[str]:
    """An http URL of ``PICTURE``, served on 127.0.0.1 (the host the head may fetch from)."""
    with served(PICTURE, "picture.png") as url:
        yield url


def test_a_question_about_images_is_answered_as_the_monolithic_model(
    omni_head: HeadProc, omni_dir: Path, picture_url: str
) -> None:
    inline = png(84, 56)  # 6 image tokens; the fetched one 4
    question = "What is in these pictures?"
    want_text, want_pcm = reference(
        omni_dir,
        [{"role": "user", "content": question}],
        "Chelsie",
        images=[inline, PICTURE],
    )

    data_url = "data:image/png;base64," + base64.b64encode(inline).decode()
    content = [
        {"type": "image_url", "image_url": {"url": data_url}},
        {"type": "image_url", "image_url": {"url": picture_url}},
        {"type": "text", "text": question},
    ]
    text, pcm = _chat(omni_head, [{"role": "user", "content": content}], "Chelsie")

    assert text == want_text
    assert pcm == want_pcm


def test_a_question_about_a_video_is_answered_as_the_monolithic_model(
    omni_head: HeadProc, omni_dir: Path
) -> None:
    clip = mp4()  # 4 frames at 2 a second: 2 temporal patches of 12 x 12 tokens
    question = "What happens in this video?"
    want_text, want_pcm = reference(
        omni_dir, [{"role": "user", "content": question}], "Chelsie", videos=[clip]
    )

    asked = video_question(clip, question)
    text, pcm, prompt_tokens = spoken_answer(omni_head, asked, "Chelsie", MAX_TOKENS)

    assert prompt_tokens > 2 * 12 * 12  # the video's tokens are in it
    assert text == want_text
    assert pcm == want_pcm


@pytest.mark.parametrize("spoken", [False, True])
def test_a_videos_own_audio_is_heard_as_the_monolithic_model_hears_it(
    omni_head: HeadProc, omni_dir: Path, spoken: bool
) -> None:
    """``use_audio_in_video``: the track's tokens interleave with the frames' by 2-second
    chunks (4 s here: frames, audio, frames, audio), and the thinker's and talker's rope
    positions follow that layout, as transformers' generate lays them out; with a spoken
    question too, its audio comes first (its features, then the track's)."""
    clip = mp4(frames=8, sound=True)  # 4 temporal patches of 12 x 12 tokens, 102 of audio
    question = "What do you hear in this video?"
    wav = tone_wav(0.7) if spoken else None
    messages = [{"role": "user", "content": question}]
    want_text, want_pcm = reference(omni_dir, messages, "Chelsie", wav, videos=[clip], sound=True)

    asked = video_question(clip, question)
    if wav is not None:
        said = {"data": base64.b64encode(wav).decode(), "format": "wav"}
        asked[0]["content"].append({"type": "input_audio", "input_audio": said})
    heard = {"mm_processor_kwargs": {"use_audio_in_video": True}}
    text, pcm, prompt_tokens = spoken_answer(omni_head, asked, "Chelsie", MAX_TOKENS, **heard)
    _, deaf_pcm, deaf_tokens = spoken_answer(omni_head, asked, "Chelsie", MAX_TOKENS)

    assert prompt_tokens == deaf_tokens + 102 + 2  # the track's tokens and its two marks
    assert text == want_text
    assert pcm == want_pcm
    assert pcm != deaf_pcm  # the track was heard


def test_hearing_a_video_without_an_audio_track_is_a_400_naming_it(omni_head: HeadProc) -> None:
    body = spoken_chat(omni_head, video_question(mp4(), "Hm?"), "Chelsie", MAX_TOKENS)
    body["mm_processor_kwargs"] = {"use_audio_in_video": True}
    response = omni_head.client.post("/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages.0.content.0"
    assert "no audio track" in error["message"]


@pytest.mark.parametrize(
    ("part", "says"),
    [
        ({"type": "image_url", "image_url": {"url": "http://localhost:9/x.png"}}, "localhost"),
        ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "video"),
    ],
)
def test_a_part_the_model_is_not_given_is_a_400_naming_it(
    omni_head: HeadProc, part: dict[str, Any], says: str
) -> None:
    content = [{"type": "text", "text": "What is this?"}, part]
    body = spoken_chat(omni_head, [{"role": "user", "content": content}], "Chelsie", MAX_TOKENS)
    response = omni_head.client.post("/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages.0.content.1"
    assert says in error["message"]


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
