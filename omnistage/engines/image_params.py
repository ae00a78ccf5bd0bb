"""An image request's params, checked: what the ``diffusion`` engine and the images route
both read. Pure Python (no torch), so the API can refuse a bad request before any replica
sees it, with the same message the engine would give.

Sizes are ``"WIDTHxHEIGHT"`` with each side a multiple of 8 (latent diffusion models
work on an 8x smaller latent grid) from ``MIN_SIDE`` up, and ``width * height`` at most
the stage's ``max_generated_image_size`` (pixels, as vLLM-Omni's flag means it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from omnistage.protocol.errors import BadRequestError

OUTPUT_FORMATS = ("png", "jpeg", "webp")
# Images one request may ask for (OpenAI's own limit for ``n``). Each is generated in
# turn on the replica, so a larger n only holds one request longer.
MAX_IMAGES = 10
SIZE_STEP = 8
# Below this the latent grid of a typical model (1/8 of the side, halved per UNet block)
# is too small to run.
MIN_SIDE = 64
# Default of ``max_generated_image_size``: OpenAI's 1024x1024.
DEFAULT_MAX_PIXELS = 1024 * 1024
MAX_STEPS = 1000  # schedulers are trained on 1000 timesteps; more cannot be scheduled
MAX_GUIDANCE = 100.0
SEED_LIMIT = 2**63  # seeds are 0 .. 2**63 - 1; image i of a request uses seed + i
MAX_NEGATIVE_PROMPT = 4000
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

    @property
    def quality(self) -> int:
        return DEFAULT_QUALITY if self.output_compression is None else self.output_compression


def parse_size(value: Any, max_pixels: int) -> tuple[int, int] | None:
    """``"WxH"`` -> (width, height); ``"auto"`` or None -> None (the stage's default)."""
    if value is None or value == "auto":
        return None
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise BadRequestError(
            f"size must be 'auto' or 'WIDTHxHEIGHT' (e.g. '512x512'), got {value!r}", "size"
        )
    width, height = int(match[1]), int(match[2])
    check_size(width, height, max_pixels)
    return width, height


def check_size(width: int, height: int, max_pixels: int) -> None:
    if width % SIZE_STEP or height % SIZE_STEP:
        raise BadRequestError(
            f"size {width}x{height}: width and height must be multiples of {SIZE_STEP}", "size"
        )
    if width < MIN_SIDE or height < MIN_SIDE:
        raise BadRequestError(
            f"size {width}x{height}: width and height must be at least {MIN_SIDE}", "size"
        )
    if width * height > max_pixels:
        raise BadRequestError(
            f"size {width}x{height} is {width * height} pixels; this server generates at "
            f"most {max_pixels} (max_generated_image_size)",
            "size",
        )


def fit_size(width: int, height: int, max_pixels: int) -> tuple[int, int]:
    """The largest size of the same shape within ``max_pixels``, sides multiples of 8."""
    scale = min(1.0, math.sqrt(max_pixels / (width * height)))
    w = max(MIN_SIDE, int(width * scale) // SIZE_STEP * SIZE_STEP)
    h = max(MIN_SIDE, int(height * scale) // SIZE_STEP * SIZE_STEP)
    return w, h


def image_job(params: dict[str, Any], max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageJob:
    """The checked params of one request; BadRequestError naming the first bad one."""
    n = _int(params, "n", 1, MAX_IMAGES)
    steps = _int(params, "num_inference_steps", 1, MAX_STEPS)
    seed = _int(params, "seed", 0, SEED_LIMIT - 1)
    compression = _int(params, "output_compression", 0, 100)
    guidance = params.get("guidance_scale")
    if guidance is not None and (
        isinstance(guidance, bool)
        or not isinstance(guidance, int | float)
        or not math.isfinite(guidance)
        or not 0 <= guidance <= MAX_GUIDANCE
    ):
        raise BadRequestError(
            f"guidance_scale must be a number from 0 to {MAX_GUIDANCE:g}, got {guidance!r}",
            "guidance_scale",
        )
    negative = params.get("negative_prompt")
    if negative is not None and (
        not isinstance(negative, str) or len(negative) > MAX_NEGATIVE_PROMPT
    ):
        raise BadRequestError(
            f"negative_prompt must be a string of at most {MAX_NEGATIVE_PROMPT} characters",
            "negative_prompt",
        )
    fmt = params.get("output_format") or "png"
    if fmt not in OUTPUT_FORMATS:
        raise BadRequestError(
            f"output_format must be one of {', '.join(OUTPUT_FORMATS)}, got {fmt!r}",
            "output_format",
        )
    return ImageJob(
        n=n if n is not None else 1,
        size=parse_size(params.get("size"), max_pixels),
        seed=seed,
        num_inference_steps=steps,
        guidance_scale=None if guidance is None else float(guidance),
        negative_prompt=negative or None,
        output_format=fmt,
        output_compression=compression,
        progress=bool(params.get("progress")),
    )


def _int(params: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequestError(
            f"{name} must be an integer from {low} to {high}, got {value!r}", name
        )
    return value
