"""The body of POST /v1/chat/completions: messages (text, audio, image and video parts,
tool calls), tools, structured output, audio output options.

Any part type parses here; which ones the served pipeline takes is the route's check
(api/media_parts.py), so a refused part is a 400 naming it, ``messages.N.content.M``."""

from __future__ import annotations

import base64
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from omnistage.api.schemas.base import Body, SamplingFields, StreamOptions


class InputAudio(Body):
    data: str = Field(min_length=1)  # base64
    # OpenAI's are wav and mp3; the listener decodes these others as well.
    format: Literal["wav", "mp3", "flac", "ogg", "webm", "m4a"] = "wav"

    def decoded(self) -> bytes:
        try:
            return base64.b64decode(self.data, validate=True)
        except ValueError:
            raise ValueError("input_audio.data must be base64") from None


class MediaUrl(Body):
    # A data: URL (base64), or an http(s) URL the operator allows fetching.
    url: str = Field(min_length=1)
    detail: str | None = None  # OpenAI's; the model sees every image whole anyway


class ContentPart(Body):
    type: str
    text: str | None = None
    input_audio: InputAudio | None = None
    image_url: MediaUrl | None = None
    video_url: MediaUrl | None = None

    @model_validator(mode="after")
    def _has_its_payload(self) -> ContentPart:
        payload = self.type in ("input_audio", "image_url", "video_url")
        if payload and getattr(self, self.type) is None:
            raise ValueError(f"an {self.type} part needs an {self.type} object")
        return self


class FunctionCallIn(Body):
    name: str
    arguments: str = "{}"


class ToolCallIn(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    # An assistant turn's function calls, and a tool turn's answer to one.
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def audio_parts(self) -> list[InputAudio]:
        if not isinstance(self.content, list):
            return []
        return [p.input_audio for p in self.content if p.input_audio is not None]

    def media_parts(self) -> list[ContentPart]:
        """Its parts other than text and audio (images, videos, and kinds unknown)."""
        if not isinstance(self.content, list):
            return []
        return [p for p in self.content if p.type not in ("text", "input_audio")]

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class FunctionDef(Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Body):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: ToolChoiceFunction


class JsonSchemaFormat(Body):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    # "schema" would shadow a BaseModel attribute.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self

    def as_param(self) -> dict[str, Any]:
        """The engine's ``response_format`` param (chat shape, plain dicts)."""
        out: dict[str, Any] = {"type": self.type}
        if self.json_schema is not None:
            out["json_schema"] = {
                "name": self.json_schema.name,
                "schema": self.json_schema.schema_,
                "strict": self.json_schema.strict,
            }
        return out


class AudioOptions(Body):
    voice: str = "default"
    format: str = "wav"


class MmProcessorKwargs(Body):
    """vLLM's per-request processor options. omnistage reads ``use_audio_in_video``
    (vLLM-Omni's switch to hear a video's own audio track, which its omni models then
    take interleaved with the frames) and refuses the others."""

    use_audio_in_video: bool = False

    @model_validator(mode="before")
    @classmethod
    def _only_known(cls, value: Any) -> Any:
        other = sorted(set(value) - {"use_audio_in_video"}) if isinstance(value, dict) else []
        if other:
            raise ValueError(f"{other[0]!r} is not supported; this server reads use_audio_in_video")
        return value


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessageIn] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # Accepted; at most one call is made per turn in required/named modes anyway.
    parallel_tool_calls: bool | None = None
    mm_processor_kwargs: MmProcessorKwargs | None = None  # vLLM's
    # vLLM's: the last message is left open and the model goes on writing it (no
    # assistant turn is started after it).
    continue_final_message: bool = False

    def audio_in_video(self) -> bool:
        return bool(self.mm_processor_kwargs and self.mm_processor_kwargs.use_audio_in_video)

    @field_validator("messages")
    @classmethod
    def _has_content(cls, value: list[ChatMessageIn]) -> list[ChatMessageIn]:
        if not any(
            m.text().strip() or m.tool_calls or m.audio_parts() or m.media_parts() for m in value
        ):
            raise ValueError("at least one message must have text, audio or image content")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _names_a_tool(cls, value: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if isinstance(value, NamedToolChoice):
            if value.function.name not in {t.function.name for t in tools}:
                raise ValueError(
                    f"tool_choice names {value.function.name!r}, which is not one of tools"
                )
        elif value == "required" and not tools:
            raise ValueError("tool_choice 'required' needs tools")
        return value

    def output_params(self) -> dict[str, Any]:
        """What only the stages writing the answer take: logprobs, structured output
        and tools (an intermediate stage must not be held to the client's schema)."""
        out: dict[str, Any] = {}
        if self.logprobs:
            out["logprobs"] = True
            out["top_logprobs"] = self.top_logprobs or 0
        if self.continue_final_message:
            out["continue_final_message"] = True
        if self.response_format is not None and self.response_format.type != "text":
            out["response_format"] = self.response_format.as_param()
        if self.tools:
            out["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
            choice = self.tool_choice or "auto"
            out["tool_choice"] = choice if isinstance(choice, str) else choice.model_dump()
        return out
