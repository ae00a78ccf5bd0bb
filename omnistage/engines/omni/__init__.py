"""Omni models as staged pipelines: Qwen2.5-Omni's thinker, talker and token2wav, each an
engine over transformers' own modules, passing tensors from stage to stage."""
