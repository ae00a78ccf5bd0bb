"""What the request bodies share: the base model, int64 bounds, the sampling fields.

Unknown fields are ignored (OpenAI clients send many); known fields are type-checked,
and a bad one is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from omnistage.protocol.params import (
    INT64_MAX,
    INT64_MIN,
    MAX_REPETITION_PENALTY,
    ParamKind,
    StageParams,
    decode,
)

# Integers travel to the replicas in msgpack, which has no bigger ones (INT64_MIN ..
# INT64_MAX): a larger value must be a 400 here, not an encoding failure (500) after the
# request has started.


def ints_fit(value: Any) -> bool:
    """Every int in a parsed JSON value is within int64 (bools are ints too; they fit)."""
    if isinstance(value, int):
        return INT64_MIN <= value <= INT64_MAX
    if isinstance(value, dict):
        return all(ints_fit(v) for v in value.values())
    if isinstance(value, list):
        return all(ints_fit(v) for v in value)
    return True


def checked_ints(value: Any) -> Any:
    if value is not None and not ints_fit(value):
        raise ValueError(f"integers must be between {INT64_MIN} and {INT64_MAX}")
    return value


# A free-form JSON object that travels to a stage: its integers must fit in int64.
JsonObject = Annotated[dict[str, Any] | None, AfterValidator(checked_ints)]
# omnistage extension: per-stage sampling overrides, keyed by stage id or name.
StageParamsField = Annotated[dict[str, dict[str, Any]] | None, AfterValidator(checked_ints)]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(Body):
    include_usage: bool = False


class SamplingFields(Body):
    """The sampling fields of /v1/chat/completions and /v1/completions."""

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
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=MAX_REPETITION_PENALTY)
    logit_bias: dict[str, float] | None = None
    stage_params: StageParamsField = None

    def output_params(self) -> dict[str, Any]:
        """Params for the stages that write the answer only (see subclasses)."""
        return {}

    def sampling_params(self) -> StageParams:
        """The sampling fields given, for every stage the request runs. Decoded, not
        just built: the struct checks what the body's schema does not (stop sequences,
        logit_bias keys)."""
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
            "repetition_penalty",
            "logit_bias",
        )
        out = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        max_tokens = self.max_completion_tokens or self.max_tokens
        if max_tokens is not None:
            out["max_tokens"] = max_tokens
        return decode(ParamKind.TEXT, out)
