"""The bodies of POST /v1/images/generations (JSON) and POST /v1/images/edits (a
multipart form: these fields, and the files the route reads itself)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from pydantic import Field, field_validator

from omnistage.api.schemas.base import INT64_MAX, Body, StageParamsField
from omnistage.protocol import params as limits
from omnistage.protocol.params import ImageParams


class ImageFields(Body):
    """What image generations and edits share: OpenAI's fields, plus omnistage's
    diffusion fields. ``size`` is checked by the routes against the image stage's
    ``max_generated_image_size``."""

    prompt: str = Field(min_length=1, max_length=32000)
    model: str | None = None
    n: int = Field(default=1, ge=1, le=limits.MAX_IMAGES)
    size: str | None = Field(default="auto", max_length=16)  # "WIDTHxHEIGHT" or "auto"
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(default=None, ge=0, le=100)
    stream: bool = False
    # Accepted and ignored: they name settings of OpenAI's own models (or, for user,
    # abuse tracking); partial_images: no previews are drawn, only finished images.
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    moderation: str | None = None
    user: str | None = None
    partial_images: int | None = Field(default=None, ge=0, le=3)
    # omnistage extensions. seed: image i is drawn with seed + i (random if not given);
    # stage: which image stage (id or name).
    seed: int | None = Field(default=None, ge=0, le=INT64_MAX)
    num_inference_steps: int | None = Field(default=None, ge=1, le=limits.MAX_STEPS)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=limits.MAX_GUIDANCE)
    negative_prompt: str | None = Field(default=None, max_length=limits.MAX_NEGATIVE_PROMPT)
    stage: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("prompt must describe the image")
        return value

    @field_validator("response_format")
    @classmethod
    def _b64_only(cls, value: str | None) -> str | None:
        if value == "url":
            raise ValueError(
                "response_format 'url' is not supported: this server stores no images; "
                "use b64_json (the default)"
            )
        return value

    def image_params(self, seed: int) -> ImageParams:
        """The image stage's params (checked here against the same limits)."""
        return ImageParams(
            n=self.n,
            size=self.size,
            seed=seed,
            num_inference_steps=self.num_inference_steps,
            guidance_scale=self.guidance_scale,
            negative_prompt=self.negative_prompt,
            output_format=self.output_format,
            output_compression=self.output_compression,
            progress=self.stream,
        )


class ImageGenerationRequest(ImageFields):
    """OpenAI's image generation body. omnistage's: revise_prompt false draws the prompt
    as given, without the stages before the image stage; stage_params as on chat."""

    revise_prompt: bool = True
    stage_params: StageParamsField = None


class ImageEditForm(ImageFields):
    """The form fields of an image edit other than the files (``image``, ``mask``).
    Form values are text; pydantic reads numbers and booleans from it."""

    # omnistage extension: how far the source is noised before denoising (0 keeps it,
    # 1 draws anew); the pipeline's default if not given.
    strength: float | None = Field(default=None, ge=0.0, le=1.0)

    def image_params(self, seed: int) -> ImageParams:
        params = super().image_params(seed)
        return msgspec.structs.replace(params, strength=self.strength)


# The edit form as /openapi.json describes it (form fields are strings, never null).
_EDIT_FIELDS: dict[str, Any] = {
    "image": {
        "description": "the image to edit (PNG, JPEG or WebP); one per request",
        "oneOf": [
            {"type": "string", "format": "binary"},
            {"type": "array", "items": {"type": "string", "format": "binary"}, "maxItems": 1},
        ],
    },
    "mask": {
        "type": "string",
        "format": "binary",
        "description": "PNG the image's size; its fully transparent pixels mark where to edit",
    },
    "prompt": {"type": "string"},
    "model": {"type": "string"},
    "n": {"type": "integer", "minimum": 1, "maximum": limits.MAX_IMAGES, "default": 1},
    "size": {"type": "string", "description": "WIDTHxHEIGHT or auto (the image's size)"},
    "response_format": {"type": "string", "enum": ["b64_json"]},
    "output_format": {"type": "string", "enum": list(limits.IMAGE_FORMATS), "default": "png"},
    "output_compression": {"type": "integer", "minimum": 0, "maximum": 100},
    "stream": {"type": "boolean", "default": False},
    "seed": {"type": "integer", "minimum": 0, "maximum": INT64_MAX},
    "strength": {"type": "number", "minimum": 0, "maximum": 1},
    "num_inference_steps": {"type": "integer", "minimum": 1, "maximum": limits.MAX_STEPS},
    "guidance_scale": {"type": "number", "minimum": 0, "maximum": limits.MAX_GUIDANCE},
    "negative_prompt": {"type": "string", "maxLength": limits.MAX_NEGATIVE_PROMPT},
    "stage": {"type": "string", "description": "omnistage: the image stage, id or name"},
}
EDIT_FORM_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["image", "prompt"],
                    "properties": _EDIT_FIELDS,
                }
            }
        },
    }
}
