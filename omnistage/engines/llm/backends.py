"""Which backend runs an llm stage's model: the fast CPU Llama forward or transformers.

``fast`` (``fast_llama``): 4-bit weights, lean forward, CPU only, Llama architecture.
``transformers``: the HF model in the configured dtype, any architecture, CPU or GPU.
``auto`` picks fast where it can run (CPU, a Llama model, torch's CPU int4 kernels),
else transformers. Both give the worker the same ``Batch`` and full logits every step,
so sampling, grammars, logprobs and exact resume are the same code on either.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnistage import envs
from omnistage.config.engine_args import LlmArgs
from omnistage.engines.llm import weights
from omnistage.engines.llm.model_defaults import read_generation_defaults
from omnistage.engines.llm.worker import Batch
from omnistage.protocol.errors import EngineError
from omnistage.protocol.params import GenerationParams

if TYPE_CHECKING:
    from omnistage.engines.llm.int4_kernel import Int4Kernel

log = logging.getLogger(__name__)

NO_SAMPLING = GenerationParams()


@dataclass(frozen=True)
class LoadedModel:
    """A model loaded to generate with, on either backend."""

    backend: str  # "fast" or "transformers"
    # What its matmuls run on, as the replica reports it: our int4 kernel's variant
    # ("int4-avx512vnni", "int4-avx2") or "torch".
    kernel: str
    batch: Batch
    tokenizer: Any
    device: Any  # torch.device
    vocab: int  # logits width (may exceed the tokenizer's)
    window: int  # the model's context window
    eos_ids: frozenset[int]
    # The model's own sampling defaults (its generation_config.json; see model_defaults).
    sampling: GenerationParams = NO_SAMPLING


def load(args: LlmArgs) -> LoadedModel:
    """Load the model behind the stage's args; blocking."""
    directory = weights.local_model_dir(args.model, args.cache_dir)  # may fetch a hub id
    envs.keep_model_hubs_offline()
    import torch

    config = json.loads((directory / "config.json").read_text())
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    why_not = _why_not_fast(config, device)
    if args.backend == "fast" and why_not:
        raise EngineError(f"backend fast cannot run {args.model}: {why_not}")
    if args.backend == "auto" and why_not:
        log.info("llm backend transformers (fast cannot: %s)", why_not)
    if args.backend == "transformers" or why_not:
        model = _load_transformers(args, config)
    else:
        model = _load_fast(directory, config, args)
    return dataclasses.replace(model, sampling=read_generation_defaults(directory))


def _why_not_fast(config: dict[str, Any], device: str) -> str | None:
    import torch

    from omnistage.engines.llm.fast_llama import supported

    if device != "cpu":
        return f"it runs on CPU only (device {device})"
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "this torch has no CPU int4 kernel"
    return supported(config)


def _load_fast(directory: Path, config: dict[str, Any], args: LlmArgs) -> LoadedModel:
    import torch
    from transformers import AutoTokenizer

    from omnistage.engines.llm.fast_llama import FastLlama
    from omnistage.engines.llm.slot_batch import SlotBatch

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = FastLlama(
        directory, _int4_kernel(args.int4_kernel), args.cache_dir, cache=args.packed_cache
    )
    _give_back_freed_memory()
    log.info(
        "loaded %s (fast, int4 matmuls on %s, weights %s) in %.2fs",
        directory.name,
        model.kernel,
        model.weights_from,
        time.monotonic() - started,
    )
    eos = _ids(config.get("eos_token_id"))
    generation = directory / "generation_config.json"
    if generation.exists():
        eos |= _ids(json.loads(generation.read_text()).get("eos_token_id"))
    eos = _with_tokenizer_eos(eos, tokenizer)
    # End-of-turn tokens cut a prompt's prefill into turns (see prefix_cache).
    batch = SlotBatch(
        model, args.max_num_seqs, eos, args.prefix_cache_tokens, answers=args.cache_answers
    )
    return LoadedModel(
        backend="fast",
        kernel=model.kernel,
        batch=batch,
        tokenizer=tokenizer,
        device=torch.device("cpu"),
        vocab=model.shape.vocab,
        window=model.shape.max_positions,
        eos_ids=eos,
    )


def _int4_kernel(choice: str) -> Int4Kernel | None:
    """Our int4 kernel, per the ``int4_kernel`` engine arg (None: torch's)."""
    from omnistage.engines.llm import int4_kernel

    if choice == "torch":
        return None
    if choice in ("auto", "omnistage"):
        kernel = int4_kernel.load()
    else:
        kernel = int4_kernel.load_variant(choice)
    if isinstance(kernel, str):
        if choice != "auto":
            raise EngineError(f"int4_kernel {choice} cannot run here: {kernel}")
        log.warning(
            "the thinker's int4 matmuls run on torch's kernel, about half the decode speed "
            "of ours, which cannot run here: %s",
            kernel,
        )
        return None
    return kernel


def _give_back_freed_memory() -> None:
    """Quantizing leaves ~0.5 GB of freed float32 temporaries in the C heap, which glibc
    keeps for reuse (RSS stays high) unless asked to return it."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to do


def _load_transformers(args: LlmArgs, config: dict[str, Any]) -> LoadedModel:
    from omnistage.engines.llm.kv_batch import HfBatch

    model, tokenizer, device = weights.load(args.model, args.dtype, args.device, args.cache_dir)
    window = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
    return LoadedModel(
        backend="transformers",
        kernel="torch",
        batch=HfBatch(model, device),
        tokenizer=tokenizer,
        device=device,
        vocab=int(getattr(model.config, "vocab_size", 0) or len(tokenizer)),
        window=window,
        eos_ids=_with_tokenizer_eos(_ids(model.generation_config.eos_token_id), tokenizer),
    )


def _ids(value: Any) -> frozenset[int]:
    if value is None:
        return frozenset()
    return frozenset(int(v) for v in (value if isinstance(value, list) else [value]))


def _with_tokenizer_eos(ids: frozenset[int], tokenizer: Any) -> frozenset[int]:
    if tokenizer.eos_token_id is None:
        return ids
    return ids | {int(tokenizer.eos_token_id)}
