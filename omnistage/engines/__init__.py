"""Engines by name. Heavy engines import their libraries only when built."""

from __future__ import annotations

from omnistage.config.schema import StageConfig
from omnistage.engines.base import Engine
from omnistage.protocol.errors import EngineError


def build_engine(stage: StageConfig) -> Engine:
    if stage.engine == "echo":
        from omnistage.engines.echo import EchoEngine

        return EchoEngine(stage)
    if stage.engine == "llm":
        from omnistage.engines.llm.engine import LlmEngine

        return LlmEngine(stage)
    if stage.engine == "tts":
        from omnistage.engines.tts import TtsEngine

        return TtsEngine(stage)
    if stage.engine == "asr":
        from omnistage.engines.asr import AsrEngine

        return AsrEngine(stage)
    if stage.engine == "diffusion":
        from omnistage.engines.diffusion import DiffusionEngine

        return DiffusionEngine(stage)
    if stage.engine == "vllm":
        from omnistage.engines.vllm_engine import VllmEngine

        return VllmEngine(stage)
    raise EngineError(
        f"engine {stage.engine!r} (stage {stage.stage_id} {stage.name!r}) is not available "
        "in this build"
    )
