"""A chat's videos for an omni thinker, prepared as its processor (``Qwen2_5OmniProcessor``
or ``Qwen3OmniMoeProcessor``, with a ``Qwen2VLVideoProcessor`` inside) prepares them when
asked to sample frames (``do_sample_frames=True``) at ``FPS`` frames a second, without the
video's audio (``use_audio_in_video=False``), and without torchvision, which that video
processor imports and which cannot sit beside this project's CPU torch build:

- decoded with PyAV, as transformers' ``read_video_pyav`` decodes (the stream's frame
  count and average rate are the metadata);
- frames sampled as ``Qwen2VLVideoProcessor.sample_frames`` samples: ``FPS`` a second,
  at least ``min_frames`` and at most the video's own, a multiple of the temporal patch
  size, evenly spaced from the first;
- every frame resized to ``smart_resize``'s size within the processor's video pixel
  bounds (128 to 768 merged patches a frame), as torchvision resizes a uint8 tensor on
  the CPU: torch's own antialiased bicubic interpolation on uint8;
- rescaled and normalised in one step (mean and std times 255, float32), and cut into
  patches of temporal patch x patch x patch (``pixel_values_videos``), the patch grid
  (t, h, w) in ``video_grid_thw``, the seconds one temporal patch spans
  (``video_second_per_grid``: temporal patch size / ``FPS``) for the rope's time
  positions;
- in the prompt one video token per merged patch between the vision start and end marks:
  ``<|VIDEO|>`` for Qwen2.5-Omni, ``<|video_pad|>`` for Qwen3-Omni.

tests/unit/test_video_in.py checks this against transformers' own code where it runs
without torchvision.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

from omnistage.protocol.errors import BadRequestError

PARAM = "video_url"  # what a 400 about a video names
FPS = 2.0  # frames sampled a second (qwen-omni-utils' rate for both models)
MIN_FRAMES, MAX_FRAMES = 4, 768  # Qwen2VLVideoProcessor's bounds on sampled frames
# The processors' bounds on a frame's pixels, in merged patches (their videos_kwargs).
MIN_TOKENS, MAX_TOKENS = 128, 768
RESCALE = 1 / 255
QWEN2_5_MARKS = ("<|vision_bos|>", "<|VIDEO|>", "<|vision_eos|>")
QWEN3_MARKS = ("<|vision_start|>", "<|video_pad|>", "<|vision_end|>")


@dataclass(frozen=True)
class VideoSettings:
    """The checkpoint's vision settings (its image processor's: the video processor
    falls back to the same preprocessor config)."""

    patch: int
    temporal: int
    merge: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    # The most tokens one video may take (the model's context; 0: no bound), checked from
    # the file's header before any frame is decoded: a long video at full size would
    # otherwise cost gigabytes of frames before the context check refused it.
    most_tokens: int = 0

    @classmethod
    def of(cls, image_processor: Any, most_tokens: int = 0) -> VideoSettings:
        p = image_processor
        return cls(
            int(p.patch_size),
            int(p.temporal_patch_size),
            int(p.merge_size),
            tuple(float(m) for m in p.image_mean),
            tuple(float(s) for s in p.image_std),
            most_tokens,
        )

    def tokens(self, frames: int, height: int, width: int) -> int:
        """How many tokens a video of ``frames`` sampled frames of this size takes."""
        factor = self.patch * self.merge
        h, w = smart_resize(height, width, factor)
        return -(-frames // self.temporal) * (h // factor) * (w // factor)


@dataclass
class VideoInput:
    pixels: Any  # (patches, channels x temporal patch x patch x patch): pixel_values_videos
    grid: Any  # (videos, 3) int64: ``video_grid_thw``
    seconds: Any  # (videos,) float: ``video_second_per_grid``
    merge: int
    marks: tuple[str, str, str] = QWEN2_5_MARKS

    def tokens(self) -> list[int]:
        """How many video tokens stand for each video."""
        return [int(thw.prod()) // self.merge**2 for thw in self.grid]

    def placeholder(self) -> str:
        start, token, end = self.marks
        return "".join(start + token * n + end for n in self.tokens())


def sample(total: int, fps: float, temporal: int) -> list[int]:
    """The frames ``Qwen2VLVideoProcessor.sample_frames`` takes at ``FPS`` a second; a
    video shorter than one temporal patch keeps every frame (patches repeat the last)."""
    import torch

    most = math.floor(min(MAX_FRAMES, total) / temporal) * temporal
    wanted = min(max(total / fps * FPS, MIN_FRAMES), most, total)
    count = math.floor(wanted / temporal) * temporal
    if count == 0:
        return list(range(total))
    return [int(i) for i in torch.arange(0, total, total / count).int()]


def decoded(index: int, data: bytes, settings: VideoSettings) -> tuple[Any, list[int]]:
    """A video file's sampled frames, (frames, height, width, 3) uint8 RGB, and which
    frames they are; a 400 when they would take more than ``settings.most_tokens``."""
    import av
    import numpy as np

    try:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            total, fps = int(stream.frames), float(stream.average_rate or 0)
            if total <= 0 or fps <= 0:  # no count in the header: count by decoding
                total = sum(1 for _ in container.decode(video=0))
                fps = fps or FPS
                container.seek(0)
            chosen = sample(total, fps, settings.temporal)
            size = (stream.height, stream.width)
            tokens = settings.tokens(len(chosen), *size) if all(size) else 0
            if settings.most_tokens and tokens > settings.most_tokens:
                raise BadRequestError(
                    f"video {index} would take {tokens} tokens, more than the model's "
                    f"context of {settings.most_tokens}; send a shorter or smaller video",
                    PARAM,
                )
            keep, frames = set(chosen), []
            for i, frame in enumerate(container.decode(video=0)):
                if i > chosen[-1]:
                    break
                if i in keep:
                    frames.append(frame.to_ndarray(format="rgb24"))
    except (av.error.FFmpegError, IndexError, ValueError, OSError):
        raise BadRequestError(f"could not decode video {index}", PARAM) from None
    if not frames:
        raise BadRequestError(f"video {index} has no frames", PARAM)
    return np.stack(frames), chosen[: len(frames)]


def smart_resize(height: int, width: int, factor: int) -> tuple[int, int]:
    """``Qwen2VLVideoProcessor``'s size: both sides multiples of ``factor`` (patch x
    merge), within the processors' video pixel bounds, the aspect ratio kept."""
    low, high = MIN_TOKENS * factor * factor, MAX_TOKENS * factor * factor
    if max(height, width) / min(height, width) > 200:
        raise BadRequestError("a video's aspect ratio must be under 200", PARAM)
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > high:
        beta = math.sqrt((height * width) / high)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < low:
        beta = math.sqrt(low / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def pixels(frames: Any, settings: VideoSettings) -> tuple[Any, tuple[int, int, int]]:
    """One video's patches and grid from its frames, (frames, height, width, 3) uint8."""
    import torch
    import torch.nn.functional as F

    video = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()  # (T, C, H, W)
    size = smart_resize(*video.shape[-2:], settings.patch * settings.merge)
    if tuple(video.shape[-2:]) != size:
        # What torchvision's resize does with a uint8 tensor on the CPU (bicubic:
        # natively in uint8, antialiased).
        video = F.interpolate(video, size=size, mode="bicubic", align_corners=False, antialias=True)
    # Rescale and normalise fused, as transformers fuses them.
    mean = torch.tensor(settings.mean) * (1.0 / RESCALE)
    std = torch.tensor(settings.std) * (1.0 / RESCALE)
    video = video.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    return patchify(video.unsqueeze(0), settings)


def patchify(videos: Any, s: VideoSettings) -> tuple[Any, tuple[int, int, int]]:
    """``Qwen2VLVideoProcessor.patchify``: (1, T, C, H, W) -> (patches, patch values)."""
    import torch

    batch, frames, channels, height, width = videos.shape
    if pad := -frames % s.temporal:  # the last frame repeats to fill the temporal patch
        videos = torch.cat((videos, videos[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
        frames += pad
    t, h, w = frames // s.temporal, height // s.patch, width // s.patch
    m, p = s.merge, s.patch
    patches = videos.view(batch, t, s.temporal, channels, h // m, m, p, w // m, m, p)
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return patches.reshape(t * h * w, channels * s.temporal * p * p), (t, h, w)


def prepare(settings: VideoSettings, files: list[bytes]) -> VideoInput:
    """Pixel values, grids and seconds per grid as the processor makes them."""
    import torch

    made = [pixels(decoded(i, data, settings)[0], settings) for i, data in enumerate(files)]
    return VideoInput(
        torch.cat([patches for patches, _ in made]),
        torch.tensor([grid for _, grid in made], dtype=torch.long),
        torch.tensor([settings.temporal / FPS] * len(made)),
        settings.merge,
    )
