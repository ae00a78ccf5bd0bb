"""The ``llm`` engine: continuous batching over the fast CPU Llama forward (4-bit weights)
or any HF transformers model (CPU or CUDA)."""
