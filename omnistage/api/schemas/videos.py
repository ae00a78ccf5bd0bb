"""The body of POST /v1/videos: OpenAI's video fields, plus omnistage's generation fields.

The official SDK sends it as a multipart form (``input_reference`` may be a file); curl
users may send JSON. Form values arrive as text, so numbers are parsed leniently
(``seconds: "4"``)."""

from __future__ import annotations

from typing import Any

from pydantic import AliasChoices, Field, field_validator

from omnistage.api.schemas.base import INT64_MAX, Body
from omnistage.protocol import params as limits
from omnistage.protocol.params import VideoParams


class VideoCreateRequest(Body):
    prompt: str = Field(min_length=1, max_length=32000)
    model: str | None = None
    # OpenAI's are "4", "8" and "12"; any positive duration up to the limit is taken.
    seconds: float | None = Field(default=None, gt=0, le=limits.MAX_VIDEO_SECONDS)
    size: str | None = Field(default=None, max_length=16)  # "WIDTHxHEIGHT"
    # omnistage extensions (also as extra_body fields of the SDK).
    seed: int | None = Field(default=None, ge=0, le=INT64_MAX)
    fps: int | None = Field(default=None, ge=1, le=limits.MAX_VIDEO_FPS)
    num_frames: int | None = Field(default=None, ge=1, le=limits.MAX_VIDEO_FRAMES)
    num_inference_steps: int | None = Field(
        default=None,
        ge=1,
        le=limits.MAX_STEPS,
        validation_alias=AliasChoices("steps", "num_inference_steps"),
    )
    guidance_scale: float | None = Field(default=None, ge=0.0, le=limits.MAX_GUIDANCE)
    negative_prompt: str | None = Field(default=None, max_length=limits.MAX_NEGATIVE_PROMPT)

    @field_validator("prompt")
    @classmethod
    def _prompt_not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("prompt must describe the video")
        return value

    def video_params(self, seed: int) -> VideoParams:
        return VideoParams(
            seconds=self.seconds,
            size=self.size,
            fps=self.fps,
            num_frames=self.num_frames,
            seed=seed,
            num_inference_steps=self.num_inference_steps,
            guidance_scale=self.guidance_scale,
            negative_prompt=self.negative_prompt,
            progress=True,
        )

    def spec(self, seed: int) -> dict[str, Any]:
        """What the job keeps to run (again): the fields given, with the seed fixed."""
        return {**self.model_dump(exclude_none=True, exclude={"model"}), "seed": seed}
