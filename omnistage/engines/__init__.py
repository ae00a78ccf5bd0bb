"""Engines by name. Heavy engines import their libraries only when built."""

from __future__ import annotations

import importlib

from omnistage.config.schema import StageConfig
from omnistage.engines.base import Engine
from omnistage.protocol.enums import EngineName
from omnistage.protocol.errors import EngineError

# Where each engine's class lives, imported when a stage is built with it.
ENGINE_CLASSES: dict[str, str] = {
    EngineName.ECHO: "omnistage.engines.echo:EchoEngine",
    EngineName.LLM: "omnistage.engines.llm.engine:LlmEngine",
    EngineName.TTS: "omnistage.engines.tts:TtsEngine",
    EngineName.ASR: "omnistage.engines.asr:AsrEngine",
    EngineName.DIFFUSION: "omnistage.engines.diffusion:DiffusionEngine",
    EngineName.VLLM: "omnistage.engines.vllm_engine:VllmEngine",
}


def build_engine(stage: StageConfig) -> Engine:
    where = ENGINE_CLASSES.get(stage.engine)
    if where is None:
        raise EngineError(
            f"engine {stage.engine!r} (stage {stage.stage_id} {stage.name!r}) is not available "
            "in this build"
        )
    module, _, name = where.partition(":")
    engine: type[Engine] = getattr(importlib.import_module(module), name)
    return engine(stage)
