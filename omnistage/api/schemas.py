"""Request bodies of the OpenAI-compatible endpoints.

Unknown fields are ignored (OpenAI clients send many); known fields are type-checked,
and a bad one is a 400 naming it.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import ClientDisconnect, Request

from omnistage.api.errors import invalid_body

M = TypeVar("M", bound=BaseModel)

# Integers travel to the replicas in msgpack, which has no bigger ones: a larger value
# must be a 400 here, not an encoding failure (500) after the request has started.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


async def parse_body(request: Request, model: type[M]) -> M:
    """Validate the JSON body straight from bytes (pydantic-core's parser: no json.loads
    pass first); a bad body is a 400 naming the field."""
    try:
        return model.model_validate_json(await read_body(request))
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from None


async def read_body(request: Request) -> bytes:
    """The whole body, read from ``receive`` directly: ``Request.body`` does the same
    through an async generator per request, which the hot path notices."""
    parts: list[bytes] = []
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting a body parsed by ``parse_body``."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessageIn(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class StreamOptions(_Body):
    include_usage: bool = False


class AudioOptions(_Body):
    voice: str = "default"
    format: str = "wav"


class SamplingFields(_Body):
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    n: int = Field(default=1, ge=1, le=16)
    # omnistage extension: per-stage sampling overrides, keyed by stage id or name.
    stage_params: dict[str, dict[str, Any]] | None = None

    @field_validator("stage_params")
    @classmethod
    def _int64_only(cls, value: dict[str, dict[str, Any]] | None) -> Any:
        if value is not None and not _ints_fit(value):
            raise ValueError(f"integers must be between {INT64_MIN} and {INT64_MAX}")
        return value

    def sampling_params(self) -> dict[str, Any]:
        keys = (
            "temperature",
            "top_p",
            "top_k",
            "stop",
            "seed",
            "presence_penalty",
            "frequency_penalty",
        )
        out = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        max_tokens = self.max_completion_tokens or self.max_tokens
        if max_tokens is not None:
            out["max_tokens"] = max_tokens
        return out


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessageIn] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOptions | None = None

    @field_validator("messages")
    @classmethod
    def _has_content(cls, value: list[ChatMessageIn]) -> list[ChatMessageIn]:
        if not any(m.text().strip() for m in value):
            raise ValueError("at least one message must have text content")
        return value


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None


class SpeechRequest(_Body):
    model: str | None = None
    input: str = Field(min_length=1, max_length=4096)
    voice: str = "default"
    response_format: Literal["wav", "pcm"] = "wav"
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    # omnistage extension: which TTS stage speaks (id or name), when there are several.
    stage: str | None = None

    @field_validator("input")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("input must contain text to speak")
        return value


def _ints_fit(value: Any) -> bool:
    """Every int in a parsed JSON value is within int64 (bools are ints too; they fit)."""
    if isinstance(value, int):
        return INT64_MIN <= value <= INT64_MAX
    if isinstance(value, dict):
        return all(_ints_fit(v) for v in value.values())
    if isinstance(value, list):
        return all(_ints_fit(v) for v in value)
    return True
