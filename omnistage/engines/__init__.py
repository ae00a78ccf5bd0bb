"""Engines by name. Heavy engines import their libraries only when built."""

from __future__ import annotations

import importlib
import os

from omnistage.config.schema import StageConfig
from omnistage.engines.base import Engine
from omnistage.protocol.enums import EngineName
from omnistage.protocol.errors import EngineError

# Where each engine's class lives, imported when a stage is built with it.
ENGINE_CLASSES: dict[str, str] = {
    EngineName.ECHO: "omnistage.engines.echo:EchoEngine",
    EngineName.LLM: "omnistage.engines.llm.engine:LlmEngine",
    EngineName.TTS: "omnistage.engines.speech.tts:TtsEngine",
    EngineName.ASR: "omnistage.engines.speech.asr:AsrEngine",
    EngineName.DIFFUSION: "omnistage.engines.image.diffusion:DiffusionEngine",
    EngineName.VLLM: "omnistage.engines.llm.vllm_engine:VllmEngine",
    EngineName.VIDEO: "omnistage.engines.video.engine:VideoEngine",
    EngineName.OMNI_THINKER: "omnistage.engines.omni.thinker:OmniThinkerEngine",
    EngineName.OMNI_TALKER: "omnistage.engines.omni.talker:OmniTalkerEngine",
    EngineName.OMNI_TOKEN2WAV: "omnistage.engines.omni.token2wav:OmniToken2WavEngine",
    EngineName.OMNI3_THINKER: "omnistage.engines.omni.qwen3_thinker:Omni3ThinkerEngine",
    EngineName.OMNI3_TALKER: "omnistage.engines.omni.qwen3_talker:Omni3TalkerEngine",
    EngineName.OMNI3_CODE2WAV: "omnistage.engines.omni.qwen3_code2wav:Omni3Code2WavEngine",
}


# Engines whose OpenMP threads should spin between ops: the thinker hands hundreds of
# small ops per decode step to its helper threads, and waking a sleeping helper for each
# cost it a third of its speed (SmolLM2, 2 cores: 73 -> 49 tok/s with PASSIVE).
SPINNING_ENGINES = frozenset({EngineName.LLM, EngineName.VLLM})


def build_engine(stage: StageConfig) -> Engine:
    where = ENGINE_CLASSES.get(stage.engine)
    if where is None:
        raise EngineError(
            f"engine {stage.engine!r} (stage {stage.stage_id} {stage.name!r}) is not available "
            "in this build"
        )
    if stage.engine not in SPINNING_ENGINES:
        # Before the engine's libraries load OpenMP (torch, CTranslate2): their threads
        # sleep when idle instead of spinning after each piece of work. Replicas of a
        # pipeline share the cores, and a listener spinning after a transcription
        # slowed the thinker answering it. An operator's own setting wins.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    module, _, name = where.partition(":")
    engine: type[Engine] = getattr(importlib.import_module(module), name)
    return engine(stage)
