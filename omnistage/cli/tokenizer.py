"""``omnistage tokenizer``: where an ``llm`` stage's tokenizer lies on this machine.

Benchmark clients (aiperf, genai-perf, vLLM's benchmark) count tokens with the served
model's tokenizer and look it up by name on a model hub, which this server never needs.
The ``llm`` engine loads from a local transformers directory (the packaged GGUF is
converted into one once), and that directory holds the tokenizer files too, so its path
is what those clients are given: ``aiperf --tokenizer "$(omnistage tokenizer)"``.
"""

from __future__ import annotations

from pathlib import Path

from omnistage.cli.args import UsageError
from omnistage.config.schema import DeployConfig, StageConfig
from omnistage.protocol.enums import EngineName, Modality


def llm_stage(config: DeployConfig, stage: str | None) -> StageConfig:
    """The named ``llm`` stage (name or id), or by default the one writing text."""
    if stage is None:
        llms = [s for s in config.stages if s.engine == EngineName.LLM]
        if not llms:
            raise UsageError(f"pipeline {config.pipeline!r} has no llm stage")
        # The stage whose text is the answer; a pipeline of several llm stages may have
        # inner ones (a planner) too.
        answering = [s for s in llms if s.final_output and s.output_modality == Modality.TEXT]
        return (answering or llms)[0]
    for s in config.stages:
        if s.name == stage or (stage.isascii() and stage.isdigit() and s.stage_id == int(stage)):
            if s.engine != EngineName.LLM:
                raise UsageError(
                    f"--stage {stage}: stage {s.stage_id} ({s.name}) runs the {s.engine!r} "
                    "engine, not llm: it has no tokenizer"
                )
            return s
    names = ", ".join(f"{s.stage_id} ({s.name})" for s in config.stages)
    raise UsageError(f"--stage {stage}: no such stage in {config.pipeline!r} (stages: {names})")


def tokenizer_dir(config: DeployConfig, stage: str | None) -> Path:
    """The local directory ``AutoTokenizer.from_pretrained`` loads the stage's tokenizer
    from (converting the packaged model on first use, ~30 s)."""
    from omnistage.config.engine_args import LlmArgs
    from omnistage.engines.llm.weights import local_model_dir

    args = LlmArgs.model_validate(llm_stage(config, stage).engine_args)
    return local_model_dir(args.model, args.cache_dir)  # EngineError: missing or broken
