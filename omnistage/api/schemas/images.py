"""The body of POST /v1/images/generations."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from omnistage.api.schemas.base import INT64_MAX, Body, StageParamsField
from omnistage.protocol import params as limits
from omnistage.protocol.params import ImageParams


class ImageGenerationRequest(Body):
    """OpenAI's image generation body, plus omnistage's diffusion fields. ``size`` is
    checked by the route against the image stage's ``max_generated_image_size``."""

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
    # revise_prompt false draws the prompt as given, without the stages before the
    # image stage; stage: which image stage (id or name); stage_params as on chat.
    seed: int | None = Field(default=None, ge=0, le=INT64_MAX)
    num_inference_steps: int | None = Field(default=None, ge=1, le=limits.MAX_STEPS)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=limits.MAX_GUIDANCE)
    negative_prompt: str | None = Field(default=None, max_length=limits.MAX_NEGATIVE_PROMPT)
    revise_prompt: bool = True
    stage: str | None = None
    stage_params: StageParamsField = None

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
