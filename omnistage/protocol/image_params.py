"""An image request as a diffusion stage draws it (``ImageJob``): the request's
``ImageParams`` with the stage's size limit applied. Pure Python (no torch), so the
images route can refuse a bad size before any replica sees it, with the same message
the engine would give.

Sizes are ``"WIDTHxHEIGHT"`` with each side a multiple of 8 (latent diffusion models
work on an 8x smaller latent grid) from ``MIN_SIDE`` up, and ``width * height`` at most
the stage's ``max_generated_image_size`` (pixels, as vLLM-Omni's flag means it). An
edit's size "auto" keeps its source image's shape (``output_size``), and its strength
must leave a step to run (``check_strength``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.params import ImageParams

SIZE_STEP = 8
# Below this the latent grid of a typical model (1/8 of the side, halved per UNet block)
# is too small to run.
MIN_SIDE = 64
# Default of ``max_generated_image_size``: OpenAI's 1024x1024.
DEFAULT_MAX_PIXELS = 1024 * 1024
# JPEG and WebP quality when the request gives no ``output_compression``.
DEFAULT_QUALITY = 95

_SIZE = re.compile(r"^([0-9]{1,5})x([0-9]{1,5})$")


@dataclass(frozen=True)
class ImageJob:
    """What one request asks of a diffusion stage; None means the stage's default."""

    n: int = 1
    size: tuple[int, int] | None = None  # (width, height); None: "auto"
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    output_format: str = "png"
    output_compression: int | None = None  # 0..100, jpeg and webp
    progress: bool = False  # stream a progress chunk after every denoising step
    strength: float | None = None  # image edits only; None: the pipeline's default

    @property
    def quality(self) -> int:
        return DEFAULT_QUALITY if self.output_compression is None else self.output_compression


def parse_size(
    value: Any,
    max_pixels: int,
    *,
    step: int = SIZE_STEP,
    min_side: int = MIN_SIDE,
    limit: str = "max_generated_image_size",
) -> tuple[int, int] | None:
    """``"WxH"`` -> (width, height); ``"auto"`` or None -> None (the stage's default).
    ``limit``: the stage setting ``max_pixels`` comes from, named in the message."""
    if value is None or value == "auto":
        return None
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise BadRequestError(
            f"size must be 'auto' or 'WIDTHxHEIGHT' (e.g. '512x512'), got {value!r}", "size"
        )
    width, height = int(match[1]), int(match[2])
    check_size(width, height, max_pixels, step=step, min_side=min_side, limit=limit)
    return width, height


def check_size(
    width: int,
    height: int,
    max_pixels: int,
    *,
    step: int = SIZE_STEP,
    min_side: int = MIN_SIDE,
    limit: str = "max_generated_image_size",
) -> None:
    if width % step or height % step:
        raise BadRequestError(
            f"size {width}x{height}: width and height must be multiples of {step}", "size"
        )
    if width < min_side or height < min_side:
        raise BadRequestError(
            f"size {width}x{height}: width and height must be at least {min_side}", "size"
        )
    if width * height > max_pixels:
        raise BadRequestError(
            f"size {width}x{height} is {width * height} pixels; this server generates at "
            f"most {max_pixels} ({limit})",
            "size",
        )


def fit_size(
    width: int, height: int, max_pixels: int, *, step: int = SIZE_STEP, min_side: int = MIN_SIDE
) -> tuple[int, int]:
    """The largest size of the same shape within ``max_pixels``, sides multiples of
    ``step``."""
    scale = min(1.0, math.sqrt(max_pixels / (width * height)))
    w = max(min_side, int(width * scale) // step * step)
    h = max(min_side, int(height * scale) // step * step)
    # A very long, thin shape: its short side was raised to min_side, so the long one
    # gives way to stay within max_pixels.
    if w * h > max_pixels:
        if h == min_side:
            w = max(min_side, max_pixels // h // step * step)
        else:
            h = max(min_side, max_pixels // w // step * step)
    return w, h


def image_job(params: ImageParams, max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageJob:
    """What one request asks, with the stage's size limit applied (every other field
    was checked where the params were decoded); BadRequestError naming ``size``."""
    return ImageJob(
        n=params.n or 1,
        size=parse_size(params.size, max_pixels),
        seed=params.seed,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        negative_prompt=params.negative_prompt or None,
        output_format=params.output_format or "png",
        output_compression=params.output_compression,
        progress=bool(params.progress),
        strength=params.strength,
    )


def output_size(
    asked: tuple[int, int] | None,
    source: tuple[int, int] | None,
    default: tuple[int, int],
    max_pixels: int,
) -> tuple[int, int]:
    """The size to draw: the one asked for; for "auto", an edit keeps its source image's
    shape (fitted within ``max_pixels``, sides multiples of 8) and a generation takes the
    stage's default."""
    if asked is not None:
        return asked
    if source is not None:
        return fit_size(*source, max_pixels)
    return default


def check_strength(steps: int, strength: float | None) -> None:
    """An edit runs the last ``int(steps * strength)`` of its steps (diffusers'
    image-to-image and inpainting pipelines): none at all cannot be drawn."""
    if strength is not None and int(steps * strength) < 1:
        raise BadRequestError(
            f"strength {strength} with {steps} inference steps leaves no denoising step "
            "(steps * strength must be at least 1): raise strength or num_inference_steps",
            "strength",
        )
