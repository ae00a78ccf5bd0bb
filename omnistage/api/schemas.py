"""Request bodies of the OpenAI-compatible endpoints.

Unknown fields are ignored (OpenAI clients send many); known fields are type-checked,
and a bad one is a 400 naming it.
"""

from __future__ import annotations

import base64
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from starlette.requests import ClientDisconnect, Request

from omnistage import tracing
from omnistage.api.errors import invalid_body
from omnistage.engines import image_params

M = TypeVar("M", bound=BaseModel)

# Integers travel to the replicas in msgpack, which has no bigger ones: a larger value
# must be a 400 here, not an encoding failure (500) after the request has started.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


async def parse_body(request: Request, model: type[M]) -> M:
    """Validate the JSON body straight from bytes (pydantic-core's parser: no json.loads
    pass first); a bad body is a 400 naming the field."""
    try:
        body = model.model_validate_json(await read_body(request))
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from None
    tracing.mark_stream(body)  # for the request's root span; nothing when tracing is off
    return body


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


class InputAudio(_Body):
    data: str = Field(min_length=1)  # base64
    # OpenAI's are wav and mp3; the listener decodes these others as well.
    format: Literal["wav", "mp3", "flac", "ogg", "webm", "m4a"] = "wav"

    def decoded(self) -> bytes:
        try:
            return base64.b64decode(self.data, validate=True)
        except ValueError:
            raise ValueError("input_audio.data must be base64") from None


class ContentPart(_Body):
    type: Literal["text", "input_audio"]
    text: str | None = None
    input_audio: InputAudio | None = None

    @model_validator(mode="after")
    def _has_its_payload(self) -> ContentPart:
        if self.type == "input_audio" and self.input_audio is None:
            raise ValueError("an input_audio part needs an input_audio object")
        return self


class FunctionCallIn(_Body):
    name: str
    arguments: str = "{}"


class ToolCallIn(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    # An assistant turn's function calls, and a tool turn's answer to one.
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        # Checked before the str | list union, whose error would name the str branch.
        # A silent drop would answer a question about an image without the image.
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "input_audio"):
                raise ValueError(
                    f"content parts of type {kind!r} are not supported by this pipeline; "
                    "only text and input_audio parts are"
                )
        return value

    def audio_parts(self) -> list[InputAudio]:
        if not isinstance(self.content, list):
            return []
        return [p.input_audio for p in self.content if p.input_audio is not None]

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: ToolChoiceFunction


class JsonSchemaFormat(_Body):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    # "schema" would shadow a BaseModel attribute.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
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
    # vLLM's extensions that benchmark clients send.
    min_tokens: int | None = Field(default=None, ge=0, le=INT64_MAX)
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    # omnistage extension: per-stage sampling overrides, keyed by stage id or name.
    stage_params: dict[str, dict[str, Any]] | None = None

    @field_validator("stage_params")
    @classmethod
    def _int64_only(cls, value: dict[str, dict[str, Any]] | None) -> Any:
        if value is not None and not _ints_fit(value):
            raise ValueError(f"integers must be between {INT64_MIN} and {INT64_MAX}")
        return value

    def output_params(self) -> dict[str, Any]:
        """Params for the stages that write the answer only (see subclasses)."""
        return {}

    def sampling_params(self) -> dict[str, Any]:
        keys = (
            "temperature",
            "top_p",
            "top_k",
            "stop",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "min_tokens",
            "ignore_eos",
            "logit_bias",
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
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # Accepted; at most one call is made per turn in required/named modes anyway.
    parallel_tool_calls: bool | None = None

    @field_validator("messages")
    @classmethod
    def _has_content(cls, value: list[ChatMessageIn]) -> list[ChatMessageIn]:
        if not any(m.text().strip() or m.tool_calls or m.audio_parts() for m in value):
            raise ValueError("at least one message must have text or audio content")
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
        if self.response_format is not None and self.response_format.type != "text":
            out["response_format"] = self.response_format.as_param()
        if self.tools:
            out["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
            choice = self.tool_choice or "auto"
            out["tool_choice"] = choice if isinstance(choice, str) else choice.model_dump()
        return out


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


class SpeechRequest(_Body):
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


def _ints_fit(value: Any) -> bool:
    """Every int in a parsed JSON value is within int64 (bools are ints too; they fit)."""
    if isinstance(value, int):
        return INT64_MIN <= value <= INT64_MAX
    if isinstance(value, dict):
        return all(_ints_fit(v) for v in value.values())
    if isinstance(value, list):
        return all(_ints_fit(v) for v in value)
    return True


# --------------------------------------------------------------------------------------
# POST /v1/responses (OpenAI's Responses API)
# --------------------------------------------------------------------------------------
#
# Where OpenAI takes "a string or a list", the string is turned into the list before
# validation: a union would report a bad list as two errors, the first of them "should
# be a valid string", and the 400 would name ``input.str``. The documented schema still
# says "string or list" (``_string_or``).


def _string_or(*fields: str) -> Any:
    """``json_schema_extra``: document each of ``fields`` as a string or what it is."""

    def patch(schema: dict[str, Any]) -> None:
        for name in fields:
            prop = schema["properties"][name]
            prop["anyOf"] = [{"type": "string"}, *prop.pop("anyOf", [prop.copy()])]
            for key in ("type", "items"):
                prop.pop(key, None)

    return patch


_MEDIA_PARTS = ("input_image", "input_file", "input_audio")


class ResponseInputPart(_Body):
    """A content part of an input message: text only (``output_text`` in an assistant
    turn a client sends back)."""

    type: Literal["input_text", "output_text"]
    text: str

    @field_validator("type", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value in _MEDIA_PARTS:
            raise ValueError(f"{value} parts are not supported: this server reads input_text")
        return value


class ResponseInputItem(_Body):
    """One item of ``input``: a message, or a function call of an earlier turn and its
    output. Which fields are required depends on ``type``."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_string_or("content", "output"))

    type: Literal["message", "function_call", "function_call_output"] = "message"
    # type "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: list[ResponseInputPart] | None = None
    # type "function_call" (call_id, name, arguments), "function_call_output" (call_id, output)
    call_id: str | None = Field(default=None, min_length=1)
    name: str | None = Field(default=None, min_length=1)
    arguments: str | None = None
    output: list[ResponseInputPart] | None = None

    @field_validator("content", "output", mode="before")
    @classmethod
    def _string_is_one_part(cls, value: Any) -> Any:
        return [{"type": "input_text", "text": value}] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> ResponseInputItem:
        needed = {
            "message": ("role", "content"),
            "function_call": ("call_id", "name", "arguments"),
            "function_call_output": ("call_id", "output"),
        }[self.type]
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.type} item needs {' and '.join(missing)}")
        return self

    def text(self) -> str:
        return "".join(p.text for p in (self.content or self.output or []))


class ResponseFunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _int64_only(cls, value: Any) -> Any:
        return _checked_ints(value)


def _or_mode_name(schema: dict[str, Any]) -> None:
    """Document ``ResponseToolChoice`` as a mode's name or the object."""
    whole = dict(schema)
    schema.clear()
    schema["anyOf"] = [{"type": "string", "enum": ["none", "auto", "required"]}, whole]


class ResponseToolChoice(_Body):
    """``tool_choice``: "none", "auto", "required" (sent as a string), or
    ``{"type": "function", "name": ...}``."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_or_mode_name)

    type: Literal["none", "auto", "required", "function"]
    name: str | None = Field(default=None, min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        return {"type": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _named_if_function(self) -> ResponseToolChoice:
        if self.type == "function" and self.name is None:
            raise ValueError("a function tool_choice needs the function's name")
        return self


class ResponseTextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    # type "json_schema"
    name: str | None = Field(default=None, min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @field_validator("schema_")
    @classmethod
    def _int64_only(cls, value: Any) -> Any:
        return _checked_ints(value)

    @model_validator(mode="after")
    def _schema_if_json_schema(self) -> ResponseTextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs name and schema")
        return self


class ResponseTextConfig(_Body):
    format: ResponseTextFormat = Field(default_factory=ResponseTextFormat)


class ResponsesRequest(_Body):
    model_config = ConfigDict(extra="ignore", json_schema_extra=_string_or("input"))

    model: str | None = None
    input: list[ResponseInputItem] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    text: ResponseTextConfig | None = None
    tools: list[ResponseFunctionTool] | None = None
    tool_choice: ResponseToolChoice | None = None
    parallel_tool_calls: bool = True
    # Accepted, but nothing is stored, so there is nothing to continue from either.
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    # omnistage extensions, as on /v1/chat/completions.
    stage_params: dict[str, dict[str, Any]] | None = None
    modalities: list[Literal["text", "audio"]] | None = None

    @field_validator("stage_params")
    @classmethod
    def _int64_only(cls, value: Any) -> Any:
        return _checked_ints(value)

    @field_validator("input", mode="before")
    @classmethod
    def _one_user_message(cls, value: Any) -> Any:
        return [{"role": "user", "content": value}] if isinstance(value, str) else value

    @field_validator("input")
    @classmethod
    def _has_content(cls, value: list[ResponseInputItem]) -> list[ResponseInputItem]:
        if not any(item.type != "message" or item.text().strip() for item in value):
            raise ValueError("input must have text in at least one message")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_sizes(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value and any(len(k) > 64 or len(v) > 512 for k, v in value.items()):
            raise ValueError("metadata keys are at most 64 characters, values at most 512")
        return value

    def sampling_params(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.max_output_tokens is not None:
            out["max_tokens"] = self.max_output_tokens
        if self.temperature is not None:
            out["temperature"] = self.temperature
        if self.top_p is not None:
            out["top_p"] = self.top_p
        return out


def _checked_ints(value: Any) -> Any:
    if value is not None and not _ints_fit(value):
        raise ValueError(f"integers must be between {INT64_MIN} and {INT64_MAX}")
    return value


# --------------------------------------------------------------------------------------
# POST /v1/images/generations
# --------------------------------------------------------------------------------------


class ImageGenerationRequest(_Body):
    """OpenAI's image generation body, plus omnistage's diffusion fields. ``size`` is
    checked by the route against the image stage's ``max_generated_image_size``."""

    prompt: str = Field(min_length=1, max_length=32000)
    model: str | None = None
    n: int = Field(default=1, ge=1, le=image_params.MAX_IMAGES)
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
    num_inference_steps: int | None = Field(default=None, ge=1, le=image_params.MAX_STEPS)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=image_params.MAX_GUIDANCE)
    negative_prompt: str | None = Field(default=None, max_length=image_params.MAX_NEGATIVE_PROMPT)
    revise_prompt: bool = True
    stage: str | None = None
    stage_params: dict[str, dict[str, Any]] | None = None

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

    @field_validator("stage_params")
    @classmethod
    def _int64_only(cls, value: Any) -> Any:
        return _checked_ints(value)

    def image_params(self, seed: int) -> dict[str, Any]:
        """The image stage's params (see engines/image_params.py)."""
        out: dict[str, Any] = {
            "n": self.n,
            "size": self.size,
            "seed": seed,
            "output_format": self.output_format,
            "progress": self.stream,
        }
        for key in (
            "num_inference_steps",
            "guidance_scale",
            "negative_prompt",
            "output_compression",
        ):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out
