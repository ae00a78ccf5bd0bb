"""The machine's own limits, measured in the benchmark's run: memory read bandwidth and
fp32 matmul throughput, and the bytes a fast-thinker decode step must read.

A decode step of a small model on a CPU is bound by memory bandwidth: every weight is
read once per step whatever the batch, and each row's KV once per step. So tok/s alone
says little across machines; tok/s x bytes per step / bandwidth says how close the
engine is to what this machine allows. Figures from one run on a shared machine are
noisy: each limit is the best of a few repeats.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

_MIB = 1 << 20


@dataclass(frozen=True)
class MachineLimits:
    read_gbs_1: float  # GB/s summing a large array on one thread
    read_gbs_all: float  # and on one thread per core at once
    matmul_gflops_1: float  # fp32 matmul on one torch thread
    threads: int

    @property
    def read_gbs(self) -> float:
        """The bandwidth limit: the better of one thread and all."""
        return max(self.read_gbs_1, self.read_gbs_all)

    def line(self) -> str:
        return (
            f"memory read {self.read_gbs_1:.1f} GB/s on 1 thread, {self.read_gbs_all:.1f} on "
            f"{self.threads}; fp32 matmul {self.matmul_gflops_1:.0f} GFLOP/s on 1 thread"
        )


def _read_once(chunks: list[np.ndarray]) -> float:
    """Seconds for one thread per chunk to sum its chunk (numpy's reduction releases the
    GIL, so the threads read at once)."""
    barrier = threading.Barrier(len(chunks) + 1)

    def read(chunk: np.ndarray) -> None:
        barrier.wait()
        chunk.sum()

    threads = [threading.Thread(target=read, args=(c,)) for c in chunks]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def read_bandwidth(threads: int, mib: int = 256, repeats: int = 5) -> float:
    """Best GB/s of ``threads`` threads summing ``mib`` MiB of float32 between them."""
    data = np.ones(mib * _MIB // 4, dtype=np.float32)
    chunks = np.array_split(data, threads)
    _read_once(chunks)  # pages touched, caches warm
    best = min(_read_once(chunks) for _ in range(repeats))
    return data.nbytes / best / 1e9


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Best fp32 GFLOP/s of an n x n matmul on one torch thread."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 2 * n**3 / best / 1e9


def measure(threads: int) -> MachineLimits:
    return MachineLimits(
        read_gbs_1=read_bandwidth(1),
        read_gbs_all=read_bandwidth(threads),
        matmul_gflops_1=matmul_gflops(),
        threads=threads,
    )


def _nbytes(*tensors: Any) -> int:
    return sum(int(t.numel() * t.element_size()) for t in tensors)


def weight_bytes_per_step(model: Any) -> int:
    """Bytes of weights a fast-thinker (``fast_llama.FastLlama``) decode step reads
    whatever its batch: every layer's int4 matrices, scales and norms, and the LM head's
    int4 first pass (the embedding rows and the head's refined rows are a few KB)."""
    total = _nbytes(model.norm) + model.head._coarse.nbytes
    for layer in model.layers:
        total += _nbytes(layer.attn_norm, layer.mlp_norm)
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            total += lin.nbytes
    return total


def kv_bytes_per_position(model: Any) -> int:
    """Bytes of K and V (float32) one cached position adds to a step's reads."""
    s = model.shape
    return s.layers * 2 * s.kv_heads * s.head_dim * 4


def step_bytes(model: Any, positions: float) -> float:
    """Bytes one decode step reads with ``positions`` cached positions over all rows."""
    return weight_bytes_per_step(model) + kv_bytes_per_position(model) * positions
