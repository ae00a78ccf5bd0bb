"""The ``llm`` engine: HF transformers models with continuous batching (CPU or CUDA)."""
