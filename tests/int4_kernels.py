"""The int4 kernels a test can run here, by name: torch's, and each of ours that loads
(the CPU runs it and a C compiler built it)."""

from __future__ import annotations

from omnistage.engines.llm import int4_kernel


def usable() -> list[str]:
    ours = [v.name for v in int4_kernel.VARIANTS]
    return ["torch", *(n for n in ours if not isinstance(int4_kernel.load_variant(n), str))]


def load(name: str) -> int4_kernel.Int4Kernel | None:
    """The kernel named (None: torch's)."""
    if name == "torch":
        return None
    kernel = int4_kernel.load_variant(name)
    assert not isinstance(kernel, str), kernel
    return kernel
