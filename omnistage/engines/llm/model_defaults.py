"""A model's own sampling defaults, from its ``generation_config.json``.

Model authors put the sampling they tuned the model for there (Llama 3: temperature 0.6,
top_p 0.9). It is the lowest layer of a request's sampling: the stage's
``default_sampling_params`` (merged by the head) and the request's own fields override
it field by field; what none of them sets takes OpenAI's defaults (``SamplingParams``).
The keys read are the ones vLLM reads; ``do_sample`` is ignored, as vLLM ignores it.
Free of torch, so any engine may use it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.params import GenerationParams, ParamKind, decode

log = logging.getLogger(__name__)

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


def read_generation_defaults(directory: Path) -> GenerationParams:
    """The sampling values of ``directory``'s generation_config.json (none when it has
    no such file, or a value our params refuse: a model file is not a request, so a bad
    value is logged and left out rather than failing every request)."""
    path = directory / "generation_config.json"
    if not path.exists():
        return GenerationParams()
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return GenerationParams()
    return generation_defaults(raw if isinstance(raw, dict) else {}, str(path))


def generation_defaults(raw: dict[str, Any], where: str = "generation_config") -> GenerationParams:
    """The sampling keys of a generation config, typed; each bad one left out."""
    kept: dict[str, Any] = {}
    for key in SAMPLING_KEYS:
        if raw.get(key) is None:
            continue
        try:
            decode(ParamKind.TEXT, {key: raw[key]})
        except BadRequestError as exc:
            log.warning("%s: ignoring %s (%s)", where, key, exc)
            continue
        kept[key] = raw[key]
    if kept:
        log.info("%s: the model's own sampling defaults %s", where, kept)
    return decode(ParamKind.TEXT, kept).generation


def under_model(model: GenerationParams, request: GenerationParams) -> GenerationParams:
    """A request's params (the stage's defaults already merged under them by the head)
    over the model's own: every field the request leaves unset takes the model's."""
    return model.merged(request) if model != GenerationParams() else request
