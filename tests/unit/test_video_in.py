"""The omni thinker's video preparation (engines/omni/video_in.py), checked against
transformers' own: its processors' video path needs torchvision, which cannot be installed
beside this project's CPU torch, so

- the whole path (PyAV decoding, frame sampling at 2 a second, resizing, rescale and
  normalise, patches, grid, seconds per grid) is compared with tests/video_reference.py,
  which runs transformers' own ``Qwen2VLVideoProcessor`` code in a process of its own
  where two torchvision functions (uint8 bicubic resize, normalize) are stood in for by
  what torchvision does on the CPU; equal to the bit;
- the normalisation and patch layout are also compared with transformers' image
  processor (its PIL path, no torchvision at all) where the maths coincide: frames already
  of a size the processor keeps, each pair of frames alike (an image is a video of one
  frame repeated over the temporal patch); equal within float rounding (the image path
  rescales, then normalises; the video path does both in one step).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests import omni3_tiny, omni_tiny
from tests.omni_tiny import mp4

pytest.importorskip("av")
pytest.importorskip("transformers")


MODELS = {"qwen2_5_omni": omni_tiny.IMAGE_PROCESSOR, "qwen3_omni_moe": omni3_tiny.IMAGE_PROCESSOR}
VIDEO = mp4(frames=6, width=84, height=56, fps=4)  # 1.5 s: at least 4 frames are sampled


@pytest.fixture(scope="module")
def wanted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """transformers' preparation of VIDEO for both models, in one process of its own
    (tests/video_reference.py)."""
    import torch

    directory = tmp_path_factory.mktemp("video-reference")
    path, out = directory / "clip.mp4", directory / "want.pt"
    path.write_bytes(VIDEO)
    jobs = [[m, str(path), s["image_mean"], s["image_std"]] for m, s in MODELS.items()]
    command = [sys.executable, "-m", "tests.video_reference", str(out), json.dumps(jobs)]
    subprocess.run(command, check=True, timeout=300)
    return dict(zip(MODELS, torch.load(out), strict=True))


@pytest.mark.parametrize("model", list(MODELS))
def test_a_video_is_prepared_as_transformers_video_processor_prepares_it(
    wanted: dict[str, dict[str, Any]], model: str
) -> None:
    from transformers import Qwen2VLImageProcessor

    from omnistage.engines.omni import video_in

    want = wanted[model]
    settings = video_in.VideoSettings.of(Qwen2VLImageProcessor(**MODELS[model]))
    got = video_in.prepare(settings, [VIDEO])

    assert got.grid.equal(want["video_grid_thw"])
    assert got.seconds.equal(want["video_second_per_grid"])
    assert got.pixels.equal(want["pixel_values_videos"])


def test_frames_are_normalised_and_patched_as_images_are() -> None:
    import numpy as np
    from transformers import Qwen2VLImageProcessor

    from omnistage.engines.omni import video_in

    image_processor = Qwen2VLImageProcessor(**omni_tiny.IMAGE_PROCESSOR)
    settings = video_in.VideoSettings.of(image_processor)
    rng = np.random.default_rng(0)
    # 336 x 336: within the video bounds (128 to 768 tokens a frame), kept as it is.
    two = rng.integers(0, 256, (2, 336, 336, 3), dtype=np.uint8)
    frames = np.repeat(two, 2, axis=0)  # frames 0, 1 alike; 2, 3 alike

    patches, grid = video_in.pixels(frames, settings)

    images = image_processor(images=list(two), return_tensors="pt")
    assert grid == (2, 24, 24)
    assert images["image_grid_thw"].tolist() == [[1, 24, 24], [1, 24, 24]]
    assert patches.shape == images["pixel_values"].shape
    assert np.allclose(patches.numpy(), images["pixel_values"].numpy(), atol=1e-5)


def test_sampling_placeholders_and_bad_files() -> None:
    from omnistage.engines.omni import video_in
    from omnistage.protocol.errors import BadRequestError

    assert video_in.sample(6, 4.0, 2) == [0, 1, 3, 4]  # 1.5 s: the 4-frame minimum
    assert video_in.sample(60, 30.0, 2) == [0, 15, 30, 45]  # 2 s at 2 frames a second
    assert video_in.sample(1, 1.0, 2) == [0]  # shorter than a temporal patch: all of it
    seen = video_in.VideoInput(None, __import__("torch").tensor([[2, 4, 4]]), None, 2)
    assert seen.placeholder() == "<|vision_bos|>" + "<|VIDEO|>" * 8 + "<|vision_eos|>"
    settings = video_in.VideoSettings(14, 2, 2, (0.5,) * 3, (0.5,) * 3)
    with pytest.raises(BadRequestError, match="video 0") as info:
        video_in.prepare(settings, [b"not a video"])
    assert info.value.param == "video_url"
    webm = mp4(form=("webm", "libvpx"))  # no frame count in its header: counted by decoding
    assert video_in.decoded(0, webm, settings)[1] == [0, 1, 2, 3]
    # 4 frames of 56 x 56: 2 temporal patches of 12 x 12 tokens (frames grow to 128 tokens
    # at least); refused from the header when the model's context is smaller.
    assert settings.tokens(4, 56, 56) == 288
    small = video_in.VideoSettings(14, 2, 2, (0.5,) * 3, (0.5,) * 3, most_tokens=287)
    with pytest.raises(BadRequestError, match="288 tokens, more than the model's context"):
        video_in.prepare(small, [mp4()])
