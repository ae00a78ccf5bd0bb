"""The ``llm`` engine: continuous batching over the fast CPU Llama forward (4-bit weights)
or any HF transformers model (CPU or CUDA)."""

import os

# Idle OpenMP threads spin after every op by default; a decode step is hundreds of small
# ops, and on a small machine the spinning steals the cores that the head, the talker or
# another replica need (measured here: 2 threads under load decode 37 tok/s spinning, 80
# passive). OpenMP reads this once, when torch loads: set before this package imports it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
