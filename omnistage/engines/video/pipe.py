"""The blocking half of the ``video`` engine: what a loaded video pipeline can do
(``VideoInfo``), making one video with it, and encoding the frames to MP4 (H.264 in
4:2:0, with PyAV's own FFmpeg). Loading and the pipeline call's common arguments are
``diffusers_pipe``'s. Everything here runs in a worker thread (``decode_image`` too);
torch, diffusers, numpy, PyAV and Pillow are imported only when it does.
"""

from __future__ import annotations

import functools
import io
import threading
from dataclasses import dataclass
from typing import Any

from omnistage.config.engine_args import VideoArgs
from omnistage.engines.image import diffusers_pipe as dp
from omnistage.protocol.errors import BadRequestError, EngineError
from omnistage.protocol.image_params import fit_size
from omnistage.protocol.video_params import EVEN, MIN_SIDE, frame_count

# H.264 encoders, best first: x264, then Cisco's OpenH264 (some FFmpeg builds have only it).
H264_ENCODERS = ("libx264", "libopenh264")
# x264's constant quality (lower is better; 18 is visually lossless, 23 its default).
CRF = "20"
# Without a size in the pipeline's __call__: Wan's 480p, landscape.
FALLBACK_SIZE = (832, 480)


@dataclass(frozen=True)
class VideoInfo(dp.PipelineInfo):
    """What the engine needs to know about a loaded video pipeline."""

    size_step: int  # width and height must be multiples of it
    frame_step: int  # the VAE's time compression: a video has 1 + k * frame_step frames
    takes_frames: bool  # num_frames (else the pipeline picks the length)
    takes_image: bool  # image-to-video: the first frame (``input_reference``)
    needs_image: bool  # ... and cannot do without one


@dataclass(frozen=True)
class Clip(dp.Call):
    """One video's call, as the engine resolved it."""

    frames: int
    fps: int
    image: Any = None  # a PIL image of the video's size, for image-to-video


@dataclass(frozen=True)
class Video:
    mp4: bytes
    thumbnail: bytes  # the first frame, PNG
    width: int
    height: int
    frames: int


def load(args: VideoArgs, model: str) -> tuple[Any, VideoInfo]:
    """The pipeline from ``model`` (a local directory), placed and described."""
    h264_encoder()  # no encoder: fail at start, not on every request
    pipe = dp.load_pipeline(args, model)
    return pipe, describe(pipe, args)


def describe(pipe: Any, args: VideoArgs) -> VideoInfo:
    params = dp.call_params(pipe)
    step = size_step(pipe)
    if args.default_size is not None:
        width, height = (int(v) for v in args.default_size.split("x"))
        if width % step or height % step:
            raise EngineError(
                f"default_size {args.default_size}: {type(pipe).__name__} needs sides that "
                f"are multiples of {step}"
            )
    else:
        width, height = _int_default(params, "width"), _int_default(params, "height")
        if width is None or height is None:
            width, height = FALLBACK_SIZE
        width, height = fit_size(
            width, height, args.max_generated_video_size, step=step, min_side=max(MIN_SIDE, step)
        )
    image = params.get("image")
    return VideoInfo(
        default_size=(width, height),
        size_step=step,
        frame_step=frame_step(pipe),
        takes_frames="num_frames" in params,
        takes_image=image is not None,
        needs_image=image is not None and image.default is image.empty,
        **dp.call_traits(pipe),
    )


def size_step(pipe: Any) -> int:
    """What width and height must be multiples of: the VAE's spatial downscaling times
    the denoiser's patch size (8 x 2 for Wan), and even for H.264."""
    spatial = _first_int(
        pipe, ("vae_scale_factor_spatial", "vae_spatial_compression_ratio", "vae_scale_factor")
    )
    denoiser = getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)
    patch = getattr(getattr(denoiser, "config", None), "patch_size", None)
    if isinstance(patch, (list, tuple)):
        patch = patch[-1]  # (time, height, width)
    step = (spatial or 8) * (patch if isinstance(patch, int) and patch > 0 else 1)
    return step if step % EVEN == 0 else step * EVEN


def frame_step(pipe: Any) -> int:
    """The VAE's time compression (4 for Wan: 4k+1 frames); 1 when it has none."""
    return _first_int(pipe, ("vae_scale_factor_temporal", "vae_temporal_compression_ratio")) or 1


def _first_int(pipe: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(pipe, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _int_default(params: Any, name: str) -> int | None:
    param = params.get(name)
    default = getattr(param, "default", None)
    return default if isinstance(default, int) and default > 0 else None


def film(
    pipe: Any,
    info: VideoInfo,
    clip: Clip,
    call_kwargs: dict[str, Any],
    stop: threading.Event,
    on_step: dp.StepHook,
) -> Video:
    """Make one video and encode it; raises Aborted once ``stop`` is set."""
    from PIL import Image

    kwargs = dp.pipeline_kwargs(info, clip, call_kwargs, stop, on_step)
    if info.takes_frames:
        kwargs["num_frames"] = clip.frames
    if clip.image is not None:
        kwargs["image"] = clip.image
    out = dp.run(pipe, {**kwargs, "output_type": "np"}, stop)
    frames = even_sides(frames_of(out))
    count, height, width = frames.shape[:3]
    thumbnail = dp.encode(Image.fromarray(frames[0]), "png", 0)
    return Video(encode_mp4(frames, clip.fps), thumbnail, width, height, count)


def frames_of(out: Any) -> Any:
    """The first video of a pipeline's output as uint8 frames, (frames, H, W, 3)."""
    import numpy as np

    video = out.frames[0]
    if isinstance(video, list):  # PIL images
        return np.stack([np.asarray(frame.convert("RGB")) for frame in video])
    array = np.asarray(video)
    if array.ndim == 4 and array.shape[1] in (1, 3) and array.shape[-1] not in (1, 3):
        array = array.transpose(0, 2, 3, 1)  # (frames, channels, H, W)
    if array.shape[-1] == 1:
        array = np.repeat(array, 3, axis=-1)
    if array.dtype != np.uint8:
        array = np.clip(array * 255 + 0.5, 0, 255).astype(np.uint8)
    return np.ascontiguousarray(array)


def even_sides(frames: Any) -> Any:
    """Frames padded by their last row/column to even sides (4:2:0 needs them); the
    engine asks for sizes that are, so this only guards a pipeline that rounds."""
    import numpy as np

    _, height, width, _ = frames.shape
    if height % EVEN == 0 and width % EVEN == 0:
        return frames
    return np.pad(frames, ((0, 0), (0, height % EVEN), (0, width % EVEN), (0, 0)), mode="edge")


@functools.cache
def h264_encoder() -> str:
    import av

    for name in H264_ENCODERS:
        if name in av.codecs_available:
            return name
    raise EngineError(
        f"PyAV's FFmpeg has no H.264 encoder ({' or '.join(H264_ENCODERS)}); install a PyAV "
        "wheel that bundles one"
    )


def encode_mp4(frames: Any, fps: int) -> bytes:
    """uint8 RGB frames (frames, H, W, 3), even sides, as an H.264 MP4 at ``fps``, made in
    memory (so without faststart: moving the index to the front rewrites a file by
    name). The same frames give the same bytes (x264 is deterministic)."""
    import av

    encoder = h264_encoder()
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream(encoder, rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        if encoder == "libx264":
            stream.options = {"crf": CRF}
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())  # flush the encoder's delayed frames
    return buf.getvalue()


def decode_image(data: bytes, width: int, height: int) -> Any:
    """A client's first frame (PNG, JPEG, WebP ...) as an RGB PIL image of the video's
    size; BadRequestError naming ``input_reference`` if it is not an image."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            rgb = image.convert("RGB")
    except Exception as exc:  # Pillow raises many kinds (and DecompressionBombError)
        raise BadRequestError(
            f"input_reference is not an image Pillow can read: {exc}", "input_reference"
        ) from None
    if rgb.size != (width, height):
        rgb = rgb.resize((width, height), Image.Resampling.LANCZOS)
    return rgb


def blank_image(width: int, height: int) -> Any:
    """A grey first frame (the warm-up of a pipeline that needs one)."""
    from PIL import Image

    return Image.new("RGB", (width, height), (128, 128, 128))


def frames_for(info: VideoInfo, asked: int, most: int) -> int:
    """The frame count the pipeline will make for ``asked`` (see ``frame_count``)."""
    return frame_count(asked, info.frame_step, most) if info.takes_frames else asked
