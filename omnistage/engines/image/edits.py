"""The source image and mask of an image edit (POST /v1/images/edits), with Pillow only
(no torch): the route checks the uploads with ``check_edit`` before anything runs; the
diffusion engine checks them again (headers only) and, in its worker thread, prepares
the init image and mask with ``prepare`` and puts the pixels it must not change back
with ``overlay``.

OpenAI's mask is an image the size of the source whose fully transparent pixels (alpha
0) mark where to edit; diffusers' inpainting pipelines take a greyscale picture, white
where to repaint: ``repaint_mask`` turns one into the other. The inpainting pipeline
re-encodes the whole picture through its VAE, which changes the kept pixels too (a
little with a trained VAE, entirely with a random one): ``overlay`` pastes the source
back outside the mask, so only what the mask marks is edited.

One source image per request: diffusers' image-to-image and inpainting pipelines start
from a single init image, and silently dropping the others would be a lie.
"""

from __future__ import annotations

import io
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError

from omnistage.protocol.errors import BadRequestError

FORMATS = ("PNG", "JPEG", "WEBP")  # what OpenAI takes
MAX_IMAGES = 1
# Decoded, 64 MP is 192 MB of RGB: a larger upload is refused before it is decoded.
MAX_SOURCE_PIXELS = 64 * 1024 * 1024
# EXIF orientations that turn the picture a quarter: its width and height swap.
_QUARTER_TURNS = {5, 6, 7, 8}
_ORIENTATION = 0x0112


def open_image(data: bytes, param: str) -> Image.Image:
    """The image's header read (no pixels decoded yet); a BadRequestError naming
    ``param`` for a file that is not a PNG, JPEG or WebP image, or too large a one."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:
        raise _too_large(param, None) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise BadRequestError(f"{param}: not a PNG, JPEG or WebP image", param) from None
    width, height = image.size
    if width * height > MAX_SOURCE_PIXELS:
        raise _too_large(param, (width, height))
    return image


def decode(data: bytes, param: str) -> Image.Image:
    """The image decoded, turned upright as its EXIF orientation says."""
    image = open_image(data, param)
    try:
        image.load()
        upright = ImageOps.exif_transpose(image)
    except (OSError, ValueError, SyntaxError) as exc:
        raise BadRequestError(
            f"{param}: the {image.format} file could not be decoded ({exc})", param
        ) from None
    return upright if upright is not None else image


def upright_size(image: Image.Image) -> tuple[int, int]:
    """The image's size once turned upright (from its header's EXIF, if any)."""
    width, height = image.size
    try:
        turned = image.getexif().get(_ORIENTATION) in _QUARTER_TURNS
    except Exception:  # unreadable EXIF: decode ignores it too
        turned = False
    return (height, width) if turned else (width, height)


def has_alpha(image: Image.Image) -> bool:
    return "A" in image.getbands() or "transparency" in image.info


def check_edit(images: list[bytes], mask: bytes | None, full: bool = True) -> tuple[int, int]:
    """The source image's (upright) size, once the uploads are known to make an edit:
    one image, and a mask (if any) with an alpha channel and the image's size.
    ``full``: decode every pixel (a damaged file is refused here); else headers only."""
    if not images:
        raise BadRequestError("image: an image file to edit is required", "image")
    if len(images) > MAX_IMAGES:
        raise BadRequestError(
            f"image: {len(images)} images given; this server edits one image per request "
            "(its diffusion pipelines start from a single image)",
            "image",
        )
    source = _read(images[0], "image", full)
    if mask is None:
        return source
    shape = open_image(mask, "mask")
    if not has_alpha(shape):
        raise BadRequestError(
            f"mask: the mask ({shape.mode}) has no alpha channel; its fully transparent "
            "pixels mark where to edit",
            "mask",
        )
    size = _read(mask, "mask", full)
    if size != source:
        raise BadRequestError(
            f"mask: the mask is {size[0]}x{size[1]} but the image {source[0]}x{source[1]}; "
            "they must be the same size",
            "mask",
        )
    return source


def _read(data: bytes, param: str, full: bool) -> tuple[int, int]:
    return decode(data, param).size if full else upright_size(open_image(data, param))


def repaint_mask(mask: Image.Image) -> Image.Image:
    """OpenAI's mask as diffusers' (mode L): 255 (repaint) where alpha is 0, else 0."""
    alpha = mask.convert("RGBA").getchannel("A")
    return alpha.point(lambda a: 255 if a == 0 else 0)


def prepare(
    image: bytes, mask: bytes | None, size: tuple[int, int]
) -> tuple[Image.Image, Image.Image | None]:
    """The init image (RGB) and repaint mask (L, or None), both at the output size."""
    init = decode(image, "image").convert("RGB")
    if init.size != size:
        init = init.resize(size, Image.Resampling.LANCZOS)
    if mask is None:
        return init, None
    repaint = repaint_mask(decode(mask, "mask"))
    if repaint.size != size:
        # Nearest: a mask stays two-valued, as the pipeline binarizes it anyway.
        repaint = repaint.resize(size, Image.Resampling.NEAREST)
    return init, repaint


def overlay(drawn: Any, init: Image.Image, repaint: Image.Image) -> Image.Image:
    """The drawn image where the mask repaints, the source image everywhere else."""
    if not isinstance(drawn, Image.Image):  # an HxWxC array in 0..1
        import numpy as np

        drawn = Image.fromarray(np.clip(np.asarray(drawn) * 255 + 0.5, 0, 255).astype("uint8"))
    drawn = drawn.convert("RGB")
    if drawn.size != init.size:
        init = init.resize(drawn.size, Image.Resampling.LANCZOS)
        repaint = repaint.resize(drawn.size, Image.Resampling.NEAREST)
    return Image.composite(drawn, init, repaint)


def _too_large(param: str, size: tuple[int, int] | None) -> BadRequestError:
    what = f"{size[0]}x{size[1]} pixels" if size else "too many pixels"
    return BadRequestError(
        f"{param}: the image is {what}; at most {MAX_SOURCE_PIXELS} pixels are taken", param
    )
