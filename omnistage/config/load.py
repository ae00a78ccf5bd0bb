"""Loading deploy configs: built-in names, YAML files, and --stage-overrides."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from omnistage.config import hub
from omnistage.config.models import pipeline_for_checkpoint
from omnistage.config.schema import DeployConfig, _LocatedError
from omnistage.protocol.errors import ConfigError

DEFAULT_PIPELINE = "voice"


def builtin_names() -> list[str]:
    root = resources.files("omnistage.config").joinpath("builtin")
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_config(
    name_or_path: str | None = None, stage_overrides: str | dict[str, Any] | None = None
) -> DeployConfig:
    """Load a built-in pipeline by name, a YAML file by path, or the pipeline a model
    checkpoint picks (``config.models``): a local directory, or a hub id fetched into
    the HF cache (``config.hub``); then apply overrides."""
    source = name_or_path or DEFAULT_PIPELINE
    raw = _read_raw(source)
    if stage_overrides:
        raw = apply_stage_overrides(raw, stage_overrides)
    return validate_config(raw, source)


def _read_raw(source: str) -> dict[str, Any]:
    path = Path(source)
    if path.is_dir():
        return pipeline_for_checkpoint(path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(source, f"cannot read deploy config: {exc.strerror}") from None
    elif source in builtin_names():
        text = resources.files("omnistage.config").joinpath(f"builtin/{source}.yaml").read_text()
    elif (hub_id := hub.parse_hub_id(source)) is not None:
        directory = hub.fetch(hub_id)
        return pipeline_for_checkpoint(directory, hub.pinned(hub_id, directory))
    else:
        raise ConfigError(
            "",
            f"{source!r} is neither a deploy config file nor a built-in pipeline "
            f"({', '.join(builtin_names())}), nor a model directory or hub id (org/name)",
        )
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise ConfigError(source, f"not valid YAML{at}: {problem}") from None
    if not isinstance(raw, dict):
        raise ConfigError(source, "a deploy config must be a YAML mapping")
    return raw


def validate_config(raw: dict[str, Any], source: str = "<config>") -> DeployConfig:
    try:
        return DeployConfig.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        ctx_error = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_error, _LocatedError):
            path = _format_path([*err["loc"], *ctx_error.path.split(".")])
            message = str(ctx_error).split(": ", 1)[1]
        else:
            path = _format_path(err["loc"])
            message = err["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{source}: {path}" if path else source, message) from None


def _format_path(loc: Any) -> str:
    """('stages', 1, 'replicas') -> 'stages[1].replicas'."""
    out = ""
    for part in loc:
        text = str(part)
        if text.isdigit():
            out += f"[{text}]"
        else:
            out += f".{text}" if out else text
    return out


def apply_stage_overrides(raw: dict[str, Any], overrides: str | dict[str, Any]) -> dict[str, Any]:
    """Merge ``{"<stage_id>": {field: value}}`` into the raw config.

    ``engine_args`` and ``default_sampling_params`` merge key by key; other fields replace.
    """
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as exc:
            raise ConfigError("--stage-overrides", f"not valid JSON: {exc.msg}") from None
    if not isinstance(overrides, dict):
        raise ConfigError("--stage-overrides", "must be a JSON object keyed by stage id")
    # Entries that are not mappings are kept as they are, for validation to report.
    stages = [dict(s) if isinstance(s, dict) else s for s in raw.get("stages") or []]
    by_id = {s.get("stage_id"): s for s in stages if isinstance(s, dict)}
    for key, fields in overrides.items():
        try:
            sid = int(key)
        except (TypeError, ValueError):
            raise ConfigError("--stage-overrides", f"key {key!r} is not a stage id") from None
        if sid not in by_id:
            raise ConfigError("--stage-overrides", f"no stage with stage_id {sid}")
        if not isinstance(fields, dict):
            raise ConfigError(f"--stage-overrides[{sid}]", "must be an object of stage fields")
        stage = by_id[sid]
        for field, value in fields.items():
            if field == "stage_id":
                raise ConfigError(f"--stage-overrides[{sid}]", "stage_id cannot be overridden")
            if field in ("engine_args", "default_sampling_params") and isinstance(value, dict):
                stage[field] = {**(stage.get(field) or {}), **value}
            else:
                stage[field] = value
    return {**raw, "stages": stages}
