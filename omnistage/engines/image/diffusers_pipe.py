"""The blocking half of the ``diffusion`` engine: loading a diffusers pipeline from a local
directory, drawing one image with it, and encoding the image. Everything here runs in a
worker thread; torch, diffusers and Pillow are imported only when it does. The ``video``
engine loads and calls its pipelines with the same pieces (``video_pipe``).

An image edit draws on a variant of the loaded pipeline (image-to-image, or inpainting
with a mask) that ``variant`` builds with diffusers' ``AutoPipelineFor*.from_pipe``: a
new pipeline object over the very same modules (no second copy of the weights).
"""

from __future__ import annotations

import copy
import inspect
import io
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistage.config.engine_args import DiffusersArgs, DiffusionArgs
from omnistage.engines.torch_threads import cores
from omnistage.protocol.errors import BadRequestError, EngineError
from omnistage.protocol.image_params import MIN_SIDE, check_strength, fit_size

log = logging.getLogger(__name__)

_DTYPES = ("float32", "float16", "bfloat16")


class Aborted(Exception):
    """Raised from the step callback to stop a generation whose request was aborted."""


@dataclass(frozen=True)
class PipelineInfo:
    """What the engine needs to know about a loaded pipeline's ``__call__``."""

    class_name: str
    default_size: tuple[int, int]  # (width, height) for size "auto"
    default_steps: int
    takes_step_callback: bool  # callback_on_step_end: per-step progress and abort
    takes_negative_prompt: bool
    takes_guidance: bool
    takes_size: bool  # width and height (an image-to-image call takes the image's)
    default_strength: float | None  # an edit pipeline's own (None: it takes no strength)


def load(args: DiffusionArgs, model: str) -> tuple[Any, PipelineInfo]:
    """The pipeline from ``model`` (a local directory), placed and configured per ``args``."""
    pipe = load_pipeline(args, model)
    return pipe, _describe(pipe, args)


def load_pipeline(args: DiffusersArgs, model: str) -> Any:
    """Any diffusers pipeline from ``model`` (a local directory), placed per ``args``."""
    import torch

    # Concurrent generations split the cores: two draws each spreading over all of them
    # would fight (and OpenMP's spinning waits make that far worse than sharing).
    torch.set_num_threads(args.torch_threads or max(1, cores() // args.max_concurrent))
    path = Path(model).expanduser()
    if not path.is_dir():
        raise EngineError(
            f"engine_args.model {model!r} is not a directory: give a local diffusers "
            "pipeline directory (one with model_index.json, as save_pretrained writes it)"
        )
    cls = _pipeline_class(args.model_class_name)
    kwargs = dict(args.diffusers_load_kwargs)
    # diffusers 0.42 renamed torch_dtype to dtype; either is accepted from the config.
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", args.dtype))
    kwargs["dtype"] = _torch_dtype(dtype)
    kwargs.setdefault("local_files_only", True)  # nothing is ever downloaded
    _quiet_progress_bars()
    try:
        pipe = cls.from_pretrained(str(path), **kwargs)
    except Exception as exc:
        raise EngineError(f"could not load the diffusers pipeline at {model}: {exc}") from exc
    pipe.set_progress_bar_config(disable=True)
    _place(pipe, args)
    return pipe


def _quiet_progress_bars() -> None:
    """diffusers and transformers draw tqdm bars while loading: noise in a server log."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


def _pipeline_class(name: str | None) -> Any:
    import diffusers

    if name is None:
        return diffusers.DiffusionPipeline  # picks the class from model_index.json
    cls = getattr(diffusers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):
        raise EngineError(
            f"model_class_name {name!r} is not a diffusers pipeline class "
            "(e.g. StableDiffusionPipeline, StableDiffusionXLPipeline, WanPipeline)"
        )
    return cls


def _torch_dtype(value: Any) -> Any:
    import torch

    if isinstance(value, str):
        if value.removeprefix("torch.") not in _DTYPES:
            raise EngineError(f"torch_dtype must be one of {', '.join(_DTYPES)}, got {value!r}")
        return getattr(torch, value.removeprefix("torch."))
    return value


def _place(pipe: Any, args: DiffusersArgs) -> None:
    import torch

    vae = getattr(pipe, "vae", None)
    for wanted, method in (
        (args.vae_use_slicing, "enable_slicing"),
        (args.vae_use_tiling, "enable_tiling"),
    ):
        if wanted:
            if vae is None or not hasattr(vae, method):
                log.warning("the pipeline's VAE has no %s(); ignoring the flag", method)
            else:
                getattr(vae, method)()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.enable_cpu_offload:
        if device == "cpu":
            # Offloading moves idle components from an accelerator to the CPU.
            log.warning("enable_cpu_offload has no effect without a GPU; running on the CPU")
        else:
            pipe.enable_model_cpu_offload(device=device)
            return
    pipe.to(device)


def _describe(pipe: Any, args: DiffusionArgs) -> PipelineInfo:
    native = _native_size(pipe)
    if args.default_size is not None:
        width, height = (int(v) for v in args.default_size.split("x"))
    else:
        width, height = fit_size(*native, args.max_generated_image_size)
    return PipelineInfo(default_size=(width, height), **call_traits(pipe))


def call_traits(pipe: Any) -> dict[str, Any]:
    """The ``PipelineInfo`` fields read off any pipeline's ``__call__``, but its size."""
    params = call_params(pipe)
    steps = params.get("num_inference_steps")
    default_steps = steps.default if steps is not None and isinstance(steps.default, int) else 50
    strength = params.get("strength")
    return {
        "class_name": type(pipe).__name__,
        "default_steps": default_steps,
        "takes_step_callback": "callback_on_step_end" in params,
        "takes_negative_prompt": "negative_prompt" in params,
        "takes_guidance": "guidance_scale" in params,
        "takes_size": "width" in params and "height" in params,
        "default_strength": (
            float(strength.default)
            if strength is not None and isinstance(strength.default, (int, float))
            else None
        ),
    }


def call_params(pipe: Any) -> Any:
    """The parameters of the pipeline's ``__call__`` (name -> inspect.Parameter)."""
    return inspect.signature(pipe.__call__).parameters


def _native_size(pipe: Any) -> tuple[int, int]:
    """The size the model was trained at, as its pipeline computes its own default."""
    scale = int(getattr(pipe, "vae_scale_factor", 8) or 8)
    side = getattr(pipe, "default_sample_size", None)  # SDXL, SD3, Flux
    if side is None:
        denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
        side = getattr(getattr(denoiser, "config", None), "sample_size", None)
    if isinstance(side, (list, tuple)):
        side = side[0]
    if not isinstance(side, int) or side <= 0:
        return 512, 512
    return max(MIN_SIDE, side * scale), max(MIN_SIDE, side * scale)


def replica_of(pipe: Any) -> Any:
    """Another handle on the same weights for a concurrent generation: a pipeline keeps
    per-call state (the scheduler's timesteps, guidance, interrupt flag) on itself, so
    two calls at once need two objects; the modules (the memory) are shared."""
    other = copy.copy(pipe)
    other.register_modules(scheduler=copy.deepcopy(pipe.scheduler))
    return other


# The variants an edit draws on: diffusers' AutoPipeline class and the request field
# that asks for it (the one a refusal names).
EDIT_VARIANTS = {
    "image-to-image": ("AutoPipelineForImage2Image", "image"),
    "inpainting": ("AutoPipelineForInpainting", "mask"),
}


def variant(pipe: Any, kind: str, args: DiffusionArgs) -> tuple[Any, PipelineInfo]:
    """The ``kind`` variant of ``pipe`` sharing its modules (its scheduler too: the slot
    that owns ``pipe`` runs one call at a time); BadRequestError if diffusers has none."""
    import diffusers

    auto, param = EDIT_VARIANTS[kind]
    try:
        other = getattr(diffusers, auto).from_pipe(pipe)
    except Exception as exc:
        raise BadRequestError(
            f"{param}: this server's image pipeline ({type(pipe).__name__}) has no "
            f"{kind} variant in diffusers, so it cannot edit images"
            + (" with a mask" if kind == "inpainting" else "")
            + f" ({exc})",
            param,
        ) from None
    other.set_progress_bar_config(disable=True)
    return other, _describe(other, args)


@dataclass(frozen=True)
class Call:
    """What every generation's call takes, as the engine resolved it."""

    prompt: str
    width: int
    height: int
    seed: int
    steps: int
    guidance_scale: float | None
    negative_prompt: str | None


@dataclass(frozen=True)
class Drawing(Call):
    """One image's call. An edit has an ``image`` (the encoded source) and maybe a
    ``mask`` (OpenAI's: transparent where to edit)."""

    output_format: str
    quality: int
    image: bytes | None = None
    mask: bytes | None = None
    strength: float | None = None

    @property
    def kind(self) -> str | None:
        """The pipeline variant it needs (None: the loaded text-to-image one)."""
        if self.image is None:
            return None
        return "image-to-image" if self.mask is None else "inpainting"


StepHook = Callable[[int, int], None]  # (steps done, total steps)


def draw(
    pipe: Any,
    info: PipelineInfo,
    job: Drawing,
    call_kwargs: dict[str, Any],
    stop: threading.Event,
    on_step: StepHook,
) -> bytes:
    """Generate one image and return it encoded; raises Aborted once ``stop`` is set."""
    kwargs = pipeline_kwargs(info, job, call_kwargs, stop, on_step)
    init, repaint = _edit_inputs(job, info, kwargs)
    out = run(pipe, {**kwargs, "output_type": "pil"}, stop)
    image = out.images[0]
    if init is not None and repaint is not None:
        from omnistage.engines.image.edits import overlay

        image = overlay(image, init, repaint)
    return encode(image, job.output_format, job.quality)


def _edit_inputs(job: Drawing, info: PipelineInfo, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """An edit's init image and repaint mask, added to the call's ``kwargs``."""
    from omnistage.engines.image.edits import prepare

    if job.image is None:
        return None, None
    init, repaint = prepare(job.image, job.mask, (job.width, job.height))
    kwargs["image"] = init
    if repaint is not None:
        kwargs["mask_image"] = repaint
    strength = job.strength if job.strength is not None else info.default_strength
    check_strength(job.steps, strength)
    if job.strength is not None:
        kwargs["strength"] = job.strength
    return init, repaint


def pipeline_kwargs(
    info: PipelineInfo,
    job: Call,
    call_kwargs: dict[str, Any],
    stop: threading.Event,
    on_step: StepHook,
) -> dict[str, Any]:
    """The pipeline call's keyword arguments for ``job`` (what every pipeline takes)."""
    import torch

    kwargs: dict[str, Any] = {
        **call_kwargs,
        "prompt": job.prompt,
        "num_inference_steps": job.steps,
        # Seeded on the CPU whatever the device: the same seed gives the same latents,
        # hence the same output, on every replica.
        "generator": torch.Generator("cpu").manual_seed(job.seed),
    }
    if info.takes_size:
        kwargs["width"], kwargs["height"] = job.width, job.height
    if job.guidance_scale is not None and info.takes_guidance:
        kwargs["guidance_scale"] = job.guidance_scale
    if job.negative_prompt and info.takes_negative_prompt:
        kwargs["negative_prompt"] = job.negative_prompt
    if info.takes_step_callback:

        def on_step_end(called: Any, step: int, _t: Any, tensors: dict[str, Any]) -> Any:
            if stop.is_set():
                raise Aborted()  # out of the denoising loop, before the VAE decode
            # The steps this call runs: an edit runs only the last strength * steps.
            total = getattr(called, "num_timesteps", None)
            on_step(step + 1, total if isinstance(total, int) and total > 0 else job.steps)
            return tensors

        kwargs["callback_on_step_end"] = on_step_end
    return kwargs


def run(pipe: Any, kwargs: dict[str, Any], stop: threading.Event) -> Any:
    """Call the pipeline; raises Aborted if ``stop`` is set before or after."""
    import torch

    if stop.is_set():
        raise Aborted()
    with torch.inference_mode():
        out = pipe(**kwargs)
    if stop.is_set():
        raise Aborted()
    return out


def encode(image: Any, fmt: str, quality: int) -> bytes:
    """A PIL image (or an HxWxC array in 0..1) as PNG, JPEG or WebP bytes."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        import numpy as np

        array = np.clip(np.asarray(image) * 255 + 0.5, 0, 255).astype("uint8")
        image = Image.fromarray(array)
    buf = io.BytesIO()
    if fmt == "png":
        image.save(buf, format="PNG")
    elif fmt == "jpeg":
        image.convert("RGB").save(buf, format="JPEG", quality=quality)
    else:
        image.save(buf, format="WEBP", quality=quality)
    return buf.getvalue()


def count_tokens(pipe: Any, text: str) -> int:
    """Prompt tokens as the pipeline's (first) text encoder reads them."""
    tokenizer = getattr(pipe, "tokenizer", None)
    if tokenizer is None:
        return len(text.split())
    try:
        ids = tokenizer(text, truncation=True).input_ids
    except Exception:
        return len(text.split())
    return len(ids)


def it_per_s(steps: int, started: float) -> float:
    elapsed = time.perf_counter() - started
    return steps / elapsed if elapsed > 0 else math.inf
