"""A checkpoint picks its pipeline: ``omnistage serve DIR`` where DIR's config.json names a
model whose stage graph we know serves that graph, built here, with no pipeline file.

The graph follows the checkpoint's ``model_type``; a deploy config (``--deploy-config``, or
a YAML naming the omni engines) still sets anything, and ``--stage-overrides`` applies to
the graph built here as to a file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omnistage.protocol.enums import EngineName
from omnistage.protocol.errors import ConfigError


def _omni(
    model: str,
    pipeline: str,
    what: str,
    engines: tuple[EngineName, EngineName, EngineName],
    names: tuple[str, str, str],
    heard: list[str],
) -> dict[str, Any]:
    """thinker (text out, and per token the tensors the talker reads) -> talker (codec
    codes) -> code-to-wave (the waveform). A text-only chat runs the thinker alone; the
    thinker reads what it ``heard`` (audio, images) itself."""
    thinker, talker, wave = engines
    return {
        "pipeline": pipeline,
        "description": f"{what} from {model}: {' -> '.join(names)}",
        "stages": [
            {
                "stage_id": 0,
                "name": names[0],
                "engine": thinker.value,
                "engine_args": {"model": model},
                "prompt_modalities": heard,
                "final_output": True,
                "output_modality": "text",
            },
            {
                "stage_id": 1,
                "name": names[1],
                "engine": talker.value,
                "engine_args": {"model": model},
                "inputs": [0],
                # The thinker's hidden states, replica to replica (never through the
                # head): shared memory on one host, zmq between hosts.
                "omni_kv_config": [{"omni_from_stage": 0, "connector_config": {"name": "shm"}}],
            },
            {
                "stage_id": 2,
                "name": names[2],
                "engine": wave.value,
                "engine_args": {"model": model},
                "inputs": [1],
                "final_output": True,
                "output_modality": "audio",
            },
        ],
    }


def qwen2_5_omni(model: str) -> dict[str, Any]:
    """Qwen2.5-Omni: thinker -> talker -> token2wav; text, spoken, image and video
    questions."""
    engines = (EngineName.OMNI_THINKER, EngineName.OMNI_TALKER, EngineName.OMNI_TOKEN2WAV)
    names = ("thinker", "talker", "token2wav")
    heard = ["text", "audio", "image", "video"]
    return _omni(model, "qwen2_5_omni", "Qwen2.5-Omni", engines, names, heard)


def qwen3_omni_moe(model: str) -> dict[str, Any]:
    """Qwen3-Omni (MoE): thinker -> talker (with its code predictor) -> code2wav; text,
    spoken, image and video questions."""
    engines = (EngineName.OMNI3_THINKER, EngineName.OMNI3_TALKER, EngineName.OMNI3_CODE2WAV)
    names = ("thinker", "talker", "code2wav")
    heard = ["text", "audio", "image", "video"]
    return _omni(model, "qwen3_omni_moe", "Qwen3-Omni", engines, names, heard)


# config.json's model_type -> the raw deploy config for a checkpoint at a path.
MODEL_PIPELINES: dict[str, Callable[[str], dict[str, Any]]] = {
    "qwen2_5_omni": qwen2_5_omni,
    "qwen3_omni_moe": qwen3_omni_moe,
}


def model_type(directory: Path) -> str | None:
    """The ``model_type`` of a checkpoint directory's config.json; None if it has none."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("model_type") if isinstance(config, dict) else None
    return value if isinstance(value, str) else None


def pipeline_for_checkpoint(directory: Path, model: str | None = None) -> dict[str, Any]:
    """The raw deploy config for a checkpoint directory, or a ConfigError saying which
    models pick their pipeline. The stages load ``model`` (a pinned hub id the directory
    was fetched for), else the directory."""
    kind = model_type(directory)
    build = MODEL_PIPELINES.get(kind or "")
    if build is None:
        known = ", ".join(sorted(MODEL_PIPELINES))
        what = f"model_type {kind!r}" if kind else "no config.json with a model_type"
        raise ConfigError(
            str(directory),
            f"a model directory picks its pipeline only for model_type {known}; this one has "
            f"{what} (give a deploy config naming its stages instead)",
        )
    return build(model or str(directory.resolve()))
