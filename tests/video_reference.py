"""transformers' own video preparation for Qwen2.5-Omni and Qwen3-Omni, run without
torchvision: ``python -m tests.video_reference OUT JOBS`` writes to OUT (torch.save), for
each job of JOBS (JSON: a list of [MODEL, VIDEO, MEAN, STD]), the ``pixel_values_videos``,
``video_grid_thw`` and ``video_second_per_grid`` the model's processor makes of the VIDEO
file when asked to sample 2 frames a second (``do_sample_frames=True, fps=2.0``), with the
checkpoint's image MEAN and STD; MODEL is ``qwen2_5_omni`` or ``qwen3_omni_moe``.

``Qwen2VLVideoProcessor`` imports torchvision at the top of its module and subclasses
torchvision's backend, so it cannot be built here (torchvision cannot sit beside this
project's CPU torch). Run in its own process (it replaces modules), this script stands in
for just two torchvision functions, with what torchvision does on the CPU:

- ``resize`` of a uint8 tensor, bicubic, antialiased: torch's ``interpolate`` on the uint8
  tensor (torchvision's native uint8 path for bicubic on the CPU);
- ``normalize``: ``image.sub_(mean).div_(std)`` per channel.

Everything else is transformers' own code, called as the processor calls it: PyAV decoding
and metadata (``read_video_pyav``), ``Qwen2VLVideoProcessor.sample_frames``,
``smart_resize`` with the omni processor's video pixel bounds (its ``videos_kwargs``),
the torchvision backend's ``resize`` and fused ``rescale_and_normalize``, and
``Qwen2VLVideoProcessor.patchify``; the seconds per grid are the processor's formula
(temporal patch size / fps).

``audio_in_video_layout`` is the processor's layout of a video whose audio it loads
(``use_audio_in_video``), from its own methods (they need no torchvision).
"""

from __future__ import annotations

import importlib
import sys
import types
from functools import partial
from types import SimpleNamespace
from typing import Any

# Settings of the tiny checkpoints' image processors (tests/omni_tiny.py, omni3_tiny.py).
SETTINGS = {
    "qwen2_5_omni": ("qwen2_5_omni.processing_qwen2_5_omni", "Qwen2_5OmniProcessor", 14),
    "qwen3_omni_moe": ("qwen3_omni_moe.processing_qwen3_omni_moe", "Qwen3OmniMoeProcessor", 16),
}
FPS = 2.0


def _stand_in_torchvision() -> None:
    import torch
    import torch.nn.functional as F

    # Made before the stand-in exists, so transformers still knows torchvision is absent.
    from transformers import image_processing_backends, video_utils  # noqa: F401

    def resize(image: Any, size: list[int], interpolation: Any, antialias: bool) -> Any:
        assert image.dtype == torch.uint8 and interpolation == "bicubic"
        return F.interpolate(
            image, size=size, mode="bicubic", align_corners=False, antialias=antialias
        )

    def normalize(image: Any, mean: Any, std: Any, inplace: bool = False) -> Any:
        image = image if inplace else image.clone()
        return image.sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))

    functional = types.ModuleType("torchvision.transforms.v2.functional")
    functional.InterpolationMode = SimpleNamespace(BICUBIC="bicubic", LANCZOS="lanczos")
    functional.resize, functional.normalize = resize, normalize
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["torchvision.transforms.v2.functional"] = functional
    image_processing_backends.tvF = functional


def reference(model: str, path: str, mean: list[float], std: list[float]) -> dict[str, Any]:
    import torch
    from transformers.image_processing_backends import TorchvisionBackend
    from transformers.image_utils import SizeDict
    from transformers.video_utils import read_video_pyav

    video_module = importlib.import_module("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    module, name, patch = SETTINGS[model]
    processor = getattr(importlib.import_module(f"transformers.models.{module}"), name)
    bounds = processor.videos_kwargs["size"]
    # The class's attributes, read past the stand-in class transformers makes of it.
    video = dict(vars(video_module.Qwen2VLVideoProcessor))
    temporal, merge = video["temporal_patch_size"], video["merge_size"]
    sampler = SimpleNamespace(
        num_frames=None,
        fps=None,
        temporal_patch_size=temporal,
        min_frames=video["min_frames"],
        max_frames=video["max_frames"],
    )
    frames, _ = read_video_pyav(path, partial(video["sample_frames"], sampler, fps=FPS))
    clip = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    height, width = video_module.smart_resize(
        *clip.shape[-2:], patch * merge, bounds["shortest_edge"], bounds["longest_edge"]
    )

    class Backend:  # the backend's methods, with what they read of their instance
        normalize = TorchvisionBackend.normalize
        _fuse_mean_std_and_rescale_factor = TorchvisionBackend._fuse_mean_std_and_rescale_factor

    clip = TorchvisionBackend.resize(
        Backend(), clip, SizeDict(height=height, width=width), resample="bicubic"
    )
    clip = TorchvisionBackend.rescale_and_normalize(
        Backend(), clip.unsqueeze(0), True, 1 / 255, True, tuple(mean), tuple(std)
    )
    patches, t, h, w = video["patchify"](None, clip, patch, merge, temporal)
    return {
        "pixel_values_videos": patches[0],
        "video_grid_thw": torch.tensor([[t, h, w]]),
        "video_second_per_grid": torch.tensor([temporal / FPS]),
    }


# Each model's marks: vision start and end, audio start and end, a video and an audio token.
MARKS = {
    "qwen2_5_omni": "<|vision_bos|> <|vision_eos|> <|audio_bos|> <|audio_eos|> <|VIDEO|> <|AUDIO|>",
    "qwen3_omni_moe": "<|vision_start|> <|vision_end|> <|audio_start|> <|audio_end|> "
    "<|video_pad|> <|audio_pad|>",
}


def audio_in_video_layout(
    grid: list[int],
    seconds: float,
    audio_tokens: int,
    model: str = "qwen2_5_omni",
    per_second: float = 25,
) -> str:
    """What the model's processor puts in a video's marks (the chat template's vision
    start and end) when it loads the video's audio, ``per_second`` rope positions a
    second (the processor's ``position_id_per_seconds``)."""
    import torch

    start, end, a_start, a_end, video, audio = MARKS[model].split()
    module, name, _ = SETTINGS[model]
    cls = getattr(importlib.import_module(f"transformers.models.{module}"), name)
    processor = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2),
        get_chunked_index=partial(cls.get_chunked_index, None),
        audio_bos_token=a_start,
        audio_eos_token=a_end,
        video_token=video,
        audio_token=audio,
    )
    videos = {"video_grid_thw": torch.tensor([grid]), "video_second_per_grid": [seconds]}
    inside = cls.replace_video_with_audio_token(
        processor,
        videos,
        0,
        {"num_audio_tokens": [audio_tokens]},
        0,
        position_id_per_seconds=per_second,
        seconds_per_chunk=2.0,
    )
    return start + inside + end


if __name__ == "__main__":
    import json

    import torch

    _stand_in_torchvision()
    out, jobs = sys.argv[1], json.loads(sys.argv[2])
    torch.save([reference(*job) for job in jobs], out)
