"""The body of POST /v1/audio/speech."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from omnistage.api.schemas.base import Body


class SpeechRequest(Body):
    model: str | None = None
    input: str = Field(min_length=1, max_length=4096)
    voice: str = "default"
    # OpenAI's formats and default; every one is 24 kHz mono (see api/audio_out.py).
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    # omnistage extension: which TTS stage speaks (id or name), when there are several.
    stage: str | None = None

    @field_validator("input")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("input must contain text to speak")
        return value
