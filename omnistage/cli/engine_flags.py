"""The diffusion flags of ``omnistage serve`` as engine_args of the diffusion stages.

vLLM-Omni configures its diffusion stages with serve flags (``--model-class-name``,
``--vae-use-slicing``, ...); here each flag sets the engine_args key of the same name in
every ``diffusion`` stage of the served pipeline, after ``--stage-overrides`` (a flag
wins), and the result is validated like the rest of the config. On a pipeline with no
diffusion stage they are an error, not ignored: a flag that silently does nothing hides
a wrong pipeline name. A ``--headless`` replica does not know its stage's engine until
the head sends the config, so there the flags join its own ``--stage-overrides`` entry
(and a non-diffusion stage refuses them when the config arrives).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from omnistage.cli.args import UsageError
from omnistage.cli.flags import DIFFUSION_FLAGS, DIFFUSION_JSON
from omnistage.config.load import validate_config
from omnistage.config.schema import DeployConfig
from omnistage.engines.image.denoising import missing_model_message
from omnistage.protocol.enums import EngineName
from omnistage.protocol.errors import ConfigError

# Engines on a local diffusers directory, which no package ships: the model is required.
DIFFUSERS_ENGINES = (EngineName.DIFFUSION, EngineName.VIDEO)
# engine_args key -> flag; the JSON ones merge key by key into the stage's own map.
FLAGS = {each.dest: each.name for each in DIFFUSION_FLAGS}


def diffusion_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine_args the given flags set (validated flags: the JSON ones parse)."""
    out: dict[str, Any] = {}
    for key in FLAGS:
        value = getattr(args, key, None)
        if value is None or value is False:
            continue
        out[key] = json.loads(value) if key in DIFFUSION_JSON else value
    return out


def _merged(engine_args: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(engine_args)
    for key, value in extra.items():
        if key in DIFFUSION_JSON and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def apply_diffusion_flags(config: DeployConfig, args: argparse.Namespace) -> DeployConfig:
    """``config`` with the flags in the engine_args of its diffusion stages."""
    extra = diffusion_engine_args(args)
    if not extra:
        return config
    if not any(s.engine == EngineName.DIFFUSION for s in config.stages):
        flags = ", ".join(FLAGS[k] for k in extra)
        raise UsageError(
            f"{flags}: pipeline {config.pipeline!r} has no diffusion stage to apply to"
        )
    raw = config.model_dump()
    for stage in raw["stages"]:
        if stage["engine"] == EngineName.DIFFUSION:
            stage["engine_args"] = _merged(stage["engine_args"], extra)
    try:
        return validate_config(raw, f"{config.pipeline} with {', '.join(FLAGS[k] for k in extra)}")
    except ConfigError as exc:
        raise UsageError(f"invalid deploy config: {exc}") from None


def check_diffusion_models(
    config: DeployConfig, local_replicas: dict[int, int], source: str
) -> None:
    """Every diffusers stage (diffusion, video) the head starts replicas of must name a
    model directory (a stage served by headless replicas may get it from their own
    overrides)."""
    for stage in config.stages:
        if stage.engine not in DIFFUSERS_ENGINES or not local_replicas.get(stage.stage_id):
            continue
        model = stage.engine_args.get("model")
        if not model:
            raise UsageError(missing_model_message(stage, source))
        if not Path(model).expanduser().is_dir():
            raise UsageError(
                f"stage {stage.stage_id} {stage.name!r}: engine_args.model {model!r} is not a "
                "directory (a local diffusers pipeline directory, with model_index.json)"
            )


def headless_overrides(overrides: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """A headless replica's own --stage-overrides entry with the flags added."""
    extra = diffusion_engine_args(args)
    if not extra:
        return overrides
    engine_args = overrides.get("engine_args")
    base = engine_args if isinstance(engine_args, dict) else {}
    return {**overrides, "engine_args": _merged(base, extra)}
