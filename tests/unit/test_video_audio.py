"""A video's own audio track for the omni models (engines/omni/video_audio.py,
``use_audio_in_video``): the prompt's interleaving of video and audio tokens by time
(Qwen2.5-Omni's chunks, Qwen3-Omni's merge) checked against ``Qwen2_5OmniProcessor``'s
and ``Qwen3OmniMoeProcessor``'s own code (their methods run without torchvision), the
track decoded as an ``input_audio`` part is, and the 400s for a video without a track."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
from pydantic import ValidationError

from omnistage.api.media_parts import MediaFetch, media_bytes
from omnistage.api.schemas.chat import ChatCompletionRequest, ContentPart
from omnistage.engines.omni import audio_in, video_audio
from omnistage.engines.omni.audio_in import AudioInput
from omnistage.engines.omni.video_audio import Soundtracks, chunk_sizes
from omnistage.engines.omni.video_in import QWEN3_MARKS, VideoInput
from omnistage.protocol.errors import ApiError, BadRequestError
from tests.omni_tiny import mp4
from tests.video_reference import audio_in_video_layout

pytest.importorskip("transformers")

SILENT, SOUNDED = mp4(), mp4(frames=8, sound=True)


@pytest.mark.parametrize(
    ("grid", "seconds", "audio_tokens"),
    [
        ([2, 24, 24], 1.0, 50),  # one chunk each: all the video, then all the audio
        ([4, 24, 24], 1.0, 102),  # the test clip: V A V A A
        ([6, 4, 6], 0.5, 40),  # more video chunks than audio ones
        ([3, 4, 4], 2.5, 7),  # a video position jumps past a whole chunk
    ],
)
def test_video_and_audio_tokens_interleave_as_qwen2_5_omnis_processor_lays_them(
    grid: list[int], seconds: float, audio_tokens: int
) -> None:
    import torch

    watched = VideoInput(None, torch.tensor([grid]), torch.tensor([seconds]), merge=2)
    sound = Soundtracks([AudioInput(None, None, audio_tokens)], 25.0, 2.0)
    assert sound.placeholder(watched) == audio_in_video_layout(grid, seconds, audio_tokens)


@pytest.mark.parametrize(
    ("grid", "seconds", "audio_tokens", "per_second"),
    [
        ([4, 24, 24], 1.0, 52, 13),  # the test clip at the processor's 13 a second
        ([4, 24, 24], 1.0, 52, 25),  # ... and at the tiny checkpoint's rope's 25
        ([6, 4, 6], 0.5, 3, 25),  # the audio runs out first
        ([3, 4, 4], 2.5, 200, 13),  # the video runs out first
    ],
)
def test_video_and_audio_tokens_merge_as_qwen3_omnis_processor_merges_them(
    grid: list[int], seconds: float, audio_tokens: int, per_second: float
) -> None:
    import torch

    watched = VideoInput(
        None, torch.tensor([grid]), torch.tensor([seconds]), merge=2, marks=QWEN3_MARKS
    )
    track = AudioInput(None, None, audio_tokens, audio_in.QWEN3_MARKS)
    sound = Soundtracks([track], per_second, 0.0)
    want = audio_in_video_layout(grid, seconds, audio_tokens, "qwen3_omni_moe", per_second)
    assert sound.placeholder(watched) == want


def test_chunk_sizes_are_the_processors_chunks() -> None:
    import numpy as np
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor

    rng = np.random.default_rng(0)
    for _ in range(50):
        positions = np.cumsum(rng.integers(0, 120, int(rng.integers(1, 30)))).tolist()
        chunks = Qwen2_5OmniProcessor.get_chunked_index(None, np.array(positions), 50)
        assert chunk_sizes(positions, 50) == [end - start for start, end in chunks]


def test_a_track_is_decoded_as_an_input_audio_part_is() -> None:
    from faster_whisper.audio import decode_audio

    samples = video_audio.track(0, SOUNDED)
    assert samples.dtype.name == "float32"
    assert samples.tolist() == decode_audio(io.BytesIO(SOUNDED), sampling_rate=16_000).tolist()
    assert 4 * 16_000 <= len(samples) < 4.2 * 16_000  # 4 s, and the AAC encoder's padding
    with pytest.raises(BadRequestError, match="video 1 has no audio track") as info:
        video_audio.track(1, SILENT)
    assert info.value.param == "mm_processor_kwargs.use_audio_in_video"


def test_the_chat_asks_to_hear_a_track_with_vllms_mm_processor_kwargs() -> None:
    messages = [{"role": "user", "content": "hi"}]
    heard = {"messages": messages, "mm_processor_kwargs": {"use_audio_in_video": True}}
    assert ChatCompletionRequest.model_validate(heard).audio_in_video()
    assert not ChatCompletionRequest.model_validate({"messages": messages}).audio_in_video()
    with pytest.raises(ValidationError, match="'fps' is not supported"):
        ChatCompletionRequest.model_validate({**heard, "mm_processor_kwargs": {"fps": 1}})


def test_a_video_without_a_track_is_a_400_naming_the_part_where_it_is_to_be_heard() -> None:
    def part(clip: bytes) -> ContentPart:
        url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
        return ContentPart.model_validate({"type": "video_url", "video_url": {"url": url}})

    where = "messages.0.content.1"
    assert asyncio.run(media_bytes(where, part(SILENT), MediaFetch())) == SILENT
    assert asyncio.run(media_bytes(where, part(SOUNDED), MediaFetch(), True)) == SOUNDED
    with pytest.raises(ApiError, match="no audio track") as info:
        asyncio.run(media_bytes(where, part(SILENT), MediaFetch(), True))
    assert info.value.param == where and info.value.status == 400


def test_a_track_longer_than_the_context_holds_is_a_400_before_it_is_decoded() -> None:
    # SOUNDED lasts 4 s: 100 Qwen2.5-Omni tokens (25 a second), 52 Qwen3-Omni ones.
    assert video_audio.most_seconds(100, 25) == 4.0 and video_audio.most_seconds(0, 25) == 0
    assert video_audio.track(0, SOUNDED, most_seconds=4.5).size > 0
    with pytest.raises(BadRequestError, match="video 3's audio track lasts 4 s") as info:
        video_audio.track(3, SOUNDED, most_seconds=3.0)
    assert info.value.param == video_audio.PARAM
