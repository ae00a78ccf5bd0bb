"""The body of POST /v1/responses (OpenAI's Responses API).

Where OpenAI takes "a string or a list", the string is turned into the list before
validation: a union would report a bad list as two errors, the first of them "should be
a valid string", and the 400 would name ``input.str``. The documented schema still says
"string or list" (``_string_or``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from omnistage.api.schemas.base import INT64_MAX, Body, JsonObject, StageParamsField
from omnistage.api.schemas.chat import AudioOptions, InputAudio, MediaUrl, MmProcessorKwargs
from omnistage.protocol.params import GenerationParams, StageParams


def _string_or(*fields: str) -> Any:
    """``json_schema_extra``: document each of ``fields`` as a string or what it is."""

    def patch(schema: dict[str, Any]) -> None:
        for name in fields:
            prop = schema["properties"][name]
            prop["anyOf"] = [{"type": "string"}, *prop.pop("anyOf", [prop.copy()])]
            for key in ("type", "items"):
                prop.pop(key, None)

    return patch


_MEDIA_PARTS = ("input_image", "input_file", "input_video")


class ResponseInputPart(Body):
    """A content part of an input message: text, spoken audio (``input_audio``, as
    chat's), a video (``video_url``, as chat's: vLLM's part, which its /v1/responses
    takes too; OpenAI has none); ``output_text`` in an assistant turn a client sends back
    (or a stored one replayed: a spoken answer's audio is not read back)."""

    type: Literal["input_text", "output_text", "input_audio", "video_url"]
    text: str | None = None
    input_audio: InputAudio | None = None
    video_url: MediaUrl | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _no_other_media(cls, value: Any) -> Any:
        if value in _MEDIA_PARTS:
            raise ValueError(
                f"{value} parts are not supported: this server reads input_text, "
                "input_audio and video_url ({'type': 'video_url', 'video_url': {'url': ...}})"
            )
        return value

    @model_validator(mode="after")
    def _has_its_payload(self) -> ResponseInputPart:
        needed = self.type if self.type in ("input_audio", "video_url") else "text"
        if getattr(self, needed) is None:
            article = "an" if self.type[0] in "aeiou" else "a"
            raise ValueError(f"{article} {self.type} part needs {needed}")
        return self


class ResponseInputItem(Body):
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
        return "".join(p.text or "" for p in (self.content or self.output or []))

    def audio_parts(self) -> list[InputAudio]:
        return [p.input_audio for p in self.content or [] if p.input_audio is not None]

    def watches(self) -> bool:
        """Whether it carries a video."""
        return any(p.video_url is not None for p in self.content or [])


class ResponseFunctionTool(Body):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: JsonObject = None
    strict: bool | None = None


def _or_mode_name(schema: dict[str, Any]) -> None:
    """Document ``ResponseToolChoice`` as a mode's name or the object."""
    whole = dict(schema)
    schema.clear()
    schema["anyOf"] = [{"type": "string", "enum": ["none", "auto", "required"]}, whole]


class ResponseToolChoice(Body):
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


class ResponseTextFormat(Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    # type "json_schema"
    name: str | None = Field(default=None, min_length=1, max_length=64)
    schema_: JsonObject = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _schema_if_json_schema(self) -> ResponseTextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs name and schema")
        return self

    def as_param(self) -> dict[str, Any] | None:
        """The chat shape of this format (the engine's ``response_format``); None for
        plain text."""
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.type == "json_schema":
            schema = {"name": self.name, "schema": self.schema_, "strict": bool(self.strict)}
            return {"type": "json_schema", "json_schema": schema}
        return None


class ResponseTextConfig(Body):
    format: ResponseTextFormat = Field(default_factory=ResponseTextFormat)


class ResponsesRequest(Body):
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
    # Stored by default, as OpenAI does (see omnistage/api/routes/responses.py).
    store: bool = True
    previous_response_id: str | None = Field(default=None, max_length=200)
    background: bool = False
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    # "auto": a conversation (previous_response_id's chain included) too long for the
    # model's window loses its oldest exchanges instead of failing, as OpenAI's.
    truncation: Literal["auto", "disabled"] = "disabled"
    # omnistage extensions, as on /v1/chat/completions.
    stage_params: StageParamsField = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOptions | None = None  # the voice and format of audio out, as chat's
    mm_processor_kwargs: MmProcessorKwargs | None = None  # vLLM's, as on chat

    def audio_in_video(self) -> bool:
        return bool(self.mm_processor_kwargs and self.mm_processor_kwargs.use_audio_in_video)

    @field_validator("input", mode="before")
    @classmethod
    def _one_user_message(cls, value: Any) -> Any:
        return [{"role": "user", "content": value}] if isinstance(value, str) else value

    @field_validator("input")
    @classmethod
    def _has_content(cls, value: list[ResponseInputItem]) -> list[ResponseInputItem]:
        if not any(
            item.type != "message" or item.text().strip() or item.audio_parts() or item.watches()
            for item in value
        ):
            raise ValueError("input must have text, audio or a video in at least one message")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_sizes(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value and any(len(k) > 64 or len(v) > 512 for k, v in value.items()):
            raise ValueError("metadata keys are at most 64 characters, values at most 512")
        return value

    def text_format(self) -> ResponseTextFormat:
        return (self.text or ResponseTextConfig()).format

    def sampling_params(self) -> StageParams:
        text = GenerationParams(
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            truncation="auto" if self.truncation == "auto" else None,
        )
        return StageParams(text=text)

    def chat_params(self) -> dict[str, Any]:
        """``text.format``, ``tools`` and ``tool_choice`` as the text stage reads them:
        in the shape of /v1/chat/completions."""
        out: dict[str, Any] = {}
        if (fmt := self.text_format().as_param()) is not None:
            out["response_format"] = fmt
        if self.tools:
            fields = {"name", "description", "parameters"}
            out["tools"] = [
                {"type": "function", "function": t.model_dump(include=fields, exclude_none=True)}
                for t in self.tools
            ]
            choice = self.tool_choice
            if choice is not None and choice.type == "function":
                out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            elif choice is not None:
                out["tool_choice"] = choice.type
        return out

    def tool_choice_setting(self) -> str | dict[str, Any]:
        """``tool_choice`` as a response repeats it."""
        choice = self.tool_choice
        if choice is None:
            return "auto"
        if choice.type == "function":
            return {"type": "function", "name": choice.name}
        return choice.type
