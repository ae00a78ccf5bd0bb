"""The body of POST /v1/completions: a plain prompt, the sampling fields."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from omnistage.api.schemas.base import SamplingFields, StreamOptions


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=1)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (insertion) is not supported")
        return value

    def output_params(self) -> dict[str, Any]:
        return {} if self.logprobs is None else {"logprobs": self.logprobs}
