"""A video request as a video stage makes it (``VideoJob``): the request's
``VideoParams`` with the stage's defaults and limits applied. Pure Python (no torch), so
a route can refuse a bad size or length before any replica sees it, with the same
message the engine would give.

Length: ``num_frames`` when given, else ``seconds * fps`` (the stage's
``default_seconds`` and ``default_fps`` for what the request leaves out), at most the
stage's ``max_frames``. A pipeline whose VAE compresses time (Wan: 4x) makes only some
counts (4k+1); ``frame_count`` picks the nearest, and the engine reports the count made.

Size: ``"WIDTHxHEIGHT"``, each side a multiple of the pipeline's spatial step (its VAE's
downscaling times its patch size, 16 for Wan; H.264 in 4:2:0 needs even sides in any
case) and at least ``MIN_SIDE``, ``width * height`` at most the stage's
``max_generated_video_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.image_params import parse_size
from omnistage.protocol.params import VideoParams

# Sides of an H.264 4:2:0 picture: its colour planes are half as wide and high.
EVEN = 2
MIN_SIDE = 16  # one H.264 macroblock
SIZE_LIMIT = "max_generated_video_size"


class VideoLimits(Protocol):
    """A video stage's defaults and limits (``config.engine_args.VideoArgs`` has them)."""

    max_generated_video_size: int
    max_frames: int
    default_fps: int
    default_seconds: float


@dataclass(frozen=True)
class VideoJob:
    """What one request asks of a video stage; None means the stage's default."""

    size: tuple[int, int] | None  # (width, height); None: "auto"
    fps: int
    frames: int  # as asked; the pipeline may make the nearest count it can
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    progress: bool = False  # stream a progress chunk after every denoising step


def video_job(params: VideoParams, args: VideoLimits, size_step: int = EVEN) -> VideoJob:
    """What one request asks, with the stage's defaults and limits applied (each field's
    own range was checked where the params were decoded). ``size_step``: the pipeline's
    spatial step when known (the engine), else only even sides are checked (a route).
    BadRequestError names the field at fault."""
    step = max(EVEN, size_step)
    size = parse_size(
        params.size,
        args.max_generated_video_size,
        step=step,
        min_side=max(MIN_SIDE, step),
        limit=SIZE_LIMIT,
    )
    return VideoJob(
        size=size,
        fps=params.fps or args.default_fps,
        frames=asked_frames(params, args),
        seed=params.seed,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        negative_prompt=params.negative_prompt or None,
        progress=bool(params.progress),
    )


def asked_frames(params: VideoParams, args: VideoLimits) -> int:
    """The frame count a request asks for: ``num_frames``, else ``seconds * fps``."""
    if params.num_frames is not None:
        if params.num_frames > args.max_frames:
            raise BadRequestError(
                f"num_frames {params.num_frames} is more than this server makes "
                f"({args.max_frames}, max_frames)",
                "num_frames",
            )
        return params.num_frames
    fps = params.fps or args.default_fps
    seconds = params.seconds if params.seconds is not None else args.default_seconds
    # The field to name: the one the client gave (seconds first; fps alone can make a
    # default length too long).
    field = "fps" if params.seconds is None and params.fps is not None else "seconds"
    frames = round(seconds * fps)
    if frames < 1:
        raise BadRequestError(f"seconds {seconds} at {fps} fps is less than one frame", field)
    if frames > args.max_frames:
        raise BadRequestError(
            f"seconds {seconds} at {fps} fps is {frames} frames; this server makes at most "
            f"{args.max_frames} (max_frames): {args.max_frames / fps:.2f}s at {fps} fps",
            field,
        )
    return frames


def frame_count(asked: int, step: int, most: int) -> int:
    """The count nearest ``asked`` (ties: the longer) that a pipeline whose VAE
    compresses time ``step`` times can make, ``1 + k * step``, and at most ``most``."""
    if step <= 1:
        return min(asked, most)
    count = 1 + (asked - 1 + step // 2) // step * step
    while count > most and count > 1:
        count -= step
    return max(1, count)
