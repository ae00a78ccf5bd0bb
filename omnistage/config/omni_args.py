"""Argument schemas of the omni model stages (engines/omni/), checked when the deploy
config loads, without importing torch or transformers.

Every stage loads the same checkpoint directory (``model``) and keeps the part it runs.
The talker's sampling defaults are transformers' own (``Qwen2_5OmniForConditionalGeneration
.generate``, ``Qwen3OmniMoeForConditionalGeneration.generate``), so a pipeline built for a
checkpoint speaks as the monolithic model does.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# Qwen2.5-Omni's token2wav and Qwen3-Omni's code2wav write 24 kHz audio.
OMNI_SAMPLE_RATE = 24000


class OmniArgs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # A Qwen2.5-Omni (config.json, weights, spk_dict.pt) or Qwen3-Omni checkpoint
    # directory, or a hub id fetched into the HF cache (config/hub.py).
    model: str = Field(min_length=1)
    # auto: cuda when available, else cpu.
    device: str = "auto"
    # auto: bfloat16 on cuda (as the checkpoint is published), float32 on the CPU (where
    # bfloat16 matmuls are slow and round differently from the monolithic fp32 model).
    # token2wav always runs in float32 (its ODE solver needs it, as transformers says).
    dtype: str = Field(default="auto", pattern="^(auto|float32|bfloat16|float16)$")


class OmniThinkerArgs(OmniArgs):
    default_max_tokens: int = Field(default=256, ge=1)


class OmniTalkerArgs(OmniArgs):
    max_new_tokens: int = Field(default=4096, ge=1)
    do_sample: bool = True
    top_k: int = Field(default=40, ge=0)
    top_p: float = Field(default=0.8, gt=0.0, le=1.0)
    temperature: float = Field(default=0.9, gt=0.0, le=2.0)
    repetition_penalty: float = Field(default=1.05, gt=0.0)
    # Codes that end an utterance; None: the talker config's codec end token.
    eos_token_ids: tuple[int, ...] | None = None
    # Codes sent downstream per chunk (the last chunk may hold fewer): fewer messages per
    # code. 4 delays no chunked token2wav whose chunks and margins are multiples of 4.
    codes_per_chunk: int = Field(default=4, ge=1)


class Omni3TalkerArgs(OmniTalkerArgs):
    # Qwen3-Omni's own defaults (``Qwen3OmniMoeForConditionalGeneration.generate``).
    top_k: int = Field(default=50, ge=0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)


class Omni3Code2WavArgs(OmniArgs):
    # Codes decoded at a time, each chunk with ``left_context_codes`` codes before it, as
    # ``Qwen3OmniMoeCode2Wav.chunked_decode`` decodes them for the monolithic model: these
    # defaults give its waveform exactly; smaller chunks give the first audio sooner, close
    # to it but not equal (code2wav is causal but looks further back than the context).
    chunk_codes: int = Field(default=300, ge=1)
    left_context_codes: int = Field(default=25, ge=0)


class OmniToken2WavArgs(OmniArgs):
    # The DiT's diffusion starts from noise drawn from this seed for every utterance, so
    # a retry (or a replica elsewhere) speaks the same waveform for the same codes.
    noise_seed: int = Field(default=0, ge=0, le=2**63 - 1)
    num_steps: int = Field(default=10, ge=1, le=1000)
    guidance_scale: float = Field(default=0.5, ge=0.0)
    sway_coefficient: float = -1.0
    # Decode in chunks of this many codes as they come, so audio leaves before the
    # talker has finished (engines/omni/code_chunks.py); 0: the whole utterance at once,
    # exactly as transformers decodes it. Each chunk is decoded with ``past_codes`` codes
    # before it and ``future_codes`` after it, and vocoded with
    # ``vocoder_context_frames`` mel frames on each side: more costs time, less moves
    # the audio further from the whole decode's.
    chunk_codes: int = Field(default=0, ge=0)
    # A real DiT block is 24 frames, 12 codes: a block of margin each side by default.
    past_codes: int = Field(default=12, ge=0)
    future_codes: int = Field(default=12, ge=0)
    vocoder_context_frames: int = Field(default=16, ge=0)
