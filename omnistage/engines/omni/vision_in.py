"""A chat's images for an omni thinker, prepared as its processor (``Qwen2_5OmniProcessor``
or ``Qwen3OmniMoeProcessor``, with a ``Qwen2VLImageProcessor`` inside) prepares them: each
image in RGB, resized so both sides are multiples of patch x merge size (28 pixels for
Qwen2.5-Omni, 32 for Qwen3-Omni: the checkpoint's preprocessor config says) within the
checkpoint's pixel bounds, normalised and cut into patches (``pixel_values``), with its
patch grid (t, h, w) in ``image_grid_thw``; in the prompt one image token per merged patch
(t x h x w / merge size squared) between the vision start and end marks: ``<|IMAGE|>``
between ``<|vision_bos|>`` and ``<|vision_eos|>`` for Qwen2.5-Omni, ``<|image_pad|>``
between ``<|vision_start|>`` and ``<|vision_end|>`` for Qwen3-Omni.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from omnistage.protocol.errors import BadRequestError

PARAM = "image_url"  # what a 400 about an image names
# An image's marks in the prompt: start, the token per merged patch, end.
QWEN2_5_MARKS = ("<|vision_bos|>", "<|IMAGE|>", "<|vision_eos|>")
QWEN3_MARKS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


@dataclass
class ImageInput:
    pixels: Any  # (patches, channels x temporal patch x patch x patch): ``pixel_values``
    grid: Any  # (images, 3) int64: ``image_grid_thw``
    merge: int  # the processor's merge size: merge x merge patches make one token
    marks: tuple[str, str, str] = QWEN2_5_MARKS

    def tokens(self) -> list[int]:
        """How many image tokens stand for each image."""
        return [int(thw.prod()) // self.merge**2 for thw in self.grid]

    def placeholder(self) -> str:
        start, token, end = self.marks
        return "".join(start + token * n + end for n in self.tokens())


def load_processor(model: str) -> Any:
    """The checkpoint's image processor (the processor's defaults without a config)."""
    from transformers import Qwen2VLImageProcessor

    try:
        return Qwen2VLImageProcessor.from_pretrained(model)
    except OSError:
        return Qwen2VLImageProcessor()


def decoded(files: list[bytes]) -> list[Any]:
    """The images of encoded files (PNG, JPEG, ...), in RGB."""
    from PIL import Image, UnidentifiedImageError

    out = []
    for index, data in enumerate(files):
        try:
            with Image.open(io.BytesIO(data)) as image:
                out.append(image.convert("RGB"))
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError):
            raise BadRequestError(f"could not decode image {index}", PARAM) from None
    return out


def prepare(processor: Any, files: list[bytes]) -> ImageInput:
    """Pixel values and grids as the processor makes them."""
    out = processor(images=decoded(files), return_tensors="pt")
    return ImageInput(out["pixel_values"], out["image_grid_thw"], int(processor.merge_size))
