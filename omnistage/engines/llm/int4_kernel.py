"""The thinker's CPU kernels: the int4 matmul, the rest of a decode step's layer (RMS norm,
SiLU-gate, RoPE + KV write + attention), the LM head's shortlist (top-k indices) and
exact pass and, on AVX512-VNNI, the whole step in one call on threads of its own. C
(``int4_kernel_*.c``, interface in ``int4_kernel.h``) built into one library when the
package is installed (setup.py), called through ctypes (~3 us a call, against ~20 small
torch ops a layer it replaces).

Why not a torch C++ extension: compiling against torch's headers takes about a minute on
two cores, these plain C files a few seconds. They use pthreads, not OpenMP: a second
OpenMP runtime in the process would fight torch's (see ``torch_threads``); the decode step
and the matmuls take ``Int4Kernel.threads``, which the model sets from the engine's
thread tuner (``FastLlama.use_threads``). ctypes lets go of the GIL during the call.

``load`` takes the best variant the CPU runs (the library asks the CPU), from a library
whose interface ``int4_abi`` has checked. Where none can run, it says why, and the
caller keeps torch's own int4 kernel.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Any

import torch

from omnistage.engines.llm.int4_abi import (
    BLOCK,
    GROUP,
    MAX_GROUP,
    MAX_HD,
    MAX_TOPK,
    VARIANTS,
    OmniLayer,
    Variant,
    cpu_lacks,
    library,
)


class Int4Kernel:
    """One variant of the loaded library, with a context of its own (working buffers
    and thread team): ``pack`` weights once, then ``matmul`` and a decode step's other
    parts per call; with ``fused``, the whole step in one (``decode_layers``,
    ``prefill_layers``)."""

    def __init__(self, lib: ctypes.CDLL, variant: Variant) -> None:
        self.variant = variant.name
        self.label = variant.label
        self.fused = variant.fused
        # Threads of our own for matmuls and the decode step (the fused variant's team;
        # set by the model from the thread tuner's count). One process, one setting.
        self.threads = 1
        # For the process's life: the team's threads wait in it between calls.
        self._lib = lib
        self._ctx = lib.omni_ctx_new()
        if not self._ctx:
            raise MemoryError("int4 kernel: no memory for its context")
        fn = functools.partial(_call, lib, variant.prefix, self._ctx)
        self._matmul = fn("matmul")
        self._attention = fn("decode_attention")
        self._prefill_attention: Any = None
        self._rms_norm = getattr(lib, variant.prefix + "rms_norm")
        self._silu_mul = getattr(lib, variant.prefix + "silu_mul")
        self._topk = getattr(lib, variant.prefix + "topk")
        self._q8_dots = getattr(lib, variant.prefix + "q8_dots")
        if not variant.fused:
            # The fused variant's prefill chunks attend inside prefill_layers.
            self._prefill_attention = fn("prefill_attention")
            return
        self._layers = fn("decode_layers")
        self._prefill_layers = fn("prefill_layers")

    def close(self) -> None:
        """End the team's threads and free the working buffers (the process's kernels
        live as long as it does; this is for one made for a while)."""
        if self._ctx:
            self._lib.omni_ctx_free(self._ctx)
            self._ctx = None

    def pack(
        self, q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Weights ``q`` [n, k] (0..15) with per-group ``scale`` and ``lo`` [n, k/32]
        (w = q * scale + lo) in the kernel's layout; ``n`` a multiple of 16."""
        n, k = q.shape
        blocks, groups = n // BLOCK, k // GROUP
        # K index = 32 g + 8 s + 4 half + t; bytes ordered (block, g, s, column, t).
        parts = q.to(torch.uint8).reshape(blocks, BLOCK, groups, 4, 2, 4)
        parts = parts.permute(0, 2, 3, 1, 5, 4)  # block, g, s, column, t, half
        packed = (parts[..., 0] | (parts[..., 1] << 4)).contiguous().reshape(-1)

        def per_block(t: torch.Tensor) -> torch.Tensor:
            t = t.reshape(blocks, BLOCK, groups).transpose(1, 2)
            return t.to(torch.float16).contiguous().reshape(-1)

        return packed, per_block(scale), per_block(lo)

    def matmul(
        self,
        x: torch.Tensor,
        packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        n: int,
        into: torch.Tensor | None = None,
        coarse: bool = False,
    ) -> torch.Tensor:
        """float32 [m, n] = float32 ``x`` [m, k] times the packed weights' transpose;
        with ``into`` (float32 [m, n], contiguous) the product is added to it.
        ``coarse``: x to ~8 bits instead of ~15 (relative error ~5e-3 against ~2e-5),
        for a shortlist that is then computed exactly."""
        x = _floats(x)
        m, k = x.shape
        w, scale, lo = packed
        y = torch.empty(m, n, dtype=torch.float32) if into is None else into
        args = (x.data_ptr(), m, k, w.data_ptr(), scale.data_ptr(), lo.data_ptr(), n)
        if self._matmul(*args, y.data_ptr(), into is not None, not coarse, self.threads) != 0:
            raise MemoryError("int4 kernel: no memory for its working buffers")
        return y

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = _floats(x)
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr())
        return out

    def topk_indices(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """int64 [rows, k]: the indices of each row's k largest values, unordered (as
        ``torch.topk(x, k, sorted=False).indices``, ties aside; k <= MAX_TOPK)."""
        x = _floats(x)
        rows, n = x.shape
        out = torch.empty(rows, k, dtype=torch.int64)
        if self._topk(x.data_ptr(), rows, n, k, out.data_ptr()) != 0:
            raise ValueError(f"top-k of {k} from rows of {n}: k must be 1..min(n, {MAX_TOPK})")
        return out

    def q8_dots(
        self, q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """float32 [rows, r]: row i of ``x`` [rows, k] times the int8 rows ``ids[i]``
        (int64 [rows, r]) of ``q`` [vocab, k] with a float32 ``scale`` [vocab, k/32] per
        group of 32 (the weights q * scale in float32)."""
        x = _floats(x)
        rows, k = x.shape
        if not (q.is_contiguous() and scale.is_contiguous() and q.dtype == torch.int8):
            raise ValueError("q8_dots needs contiguous int8 rows and float32 scales")
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(rows, ids.shape[1], dtype=torch.float32)
        self._q8_dots(
            q.data_ptr(),
            scale.data_ptr(),
            k,
            x.data_ptr(),
            ids.data_ptr(),
            rows,
            ids.shape[1],
            out.data_ptr(),
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of rows [gate, up]."""
        gate_up = _floats(gate_up)
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, width, dtype=torch.float32)
        self._silu_mul(gate_up.data_ptr(), rows, width, out.data_ptr())
        return out

    def attention(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        heads: int,
        rope: torch.Tensor,
        slot: int | None = None,
    ) -> torch.Tensor:
        """RoPE, the rows' K/V into the cache ``keys``/``values`` [slots, kv_heads,
        capacity, hd], and attention; ``positions`` int64, ``rope`` [positions, hd/2, 2]
        (cos, sin). A decode step's rows (``slot`` None): one new token per row, row r in
        slot r at ``positions[r]``. A prefill chunk's (the non-fused variant's; the fused
        one's attend inside ``prefill_layers``): one sequence's tokens at ``positions``
        (ascending) in ``slot``, each attending to the slot's positions up to its own,
        with the bits the decode step computing it alone would give."""
        fn = self._attention
        if slot is not None:
            if self._prefill_attention is None:
                raise ValueError(f"{self.variant}: a prefill chunk attends in prefill_layers")
            fn, keys, values = self._prefill_attention, keys[slot], values[slot]
        qkv = _floats(qkv)
        if not (keys.is_contiguous() and values.is_contiguous()):
            raise ValueError("the attention needs contiguous caches")
        positions = positions.to(torch.int64).contiguous()
        kv_heads, capacity, hd = keys.shape[-3], keys.shape[-2], keys.shape[-1]
        out = torch.empty(qkv.shape[0], heads * hd, dtype=torch.float32)
        args = (qkv.data_ptr(), qkv.shape[0], heads, kv_heads, hd, rope.data_ptr())
        caches = (positions.data_ptr(), keys.data_ptr(), values.data_ptr(), capacity)
        if fn(*args, *caches, out.data_ptr()) != 0:
            raise MemoryError("the attention: no memory for its working buffers")
        return out

    def decode_layers(
        self,
        h: torch.Tensor,
        table: ctypes.Array[OmniLayer],
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        shape: Any,
        rope: torch.Tensor,
        positions: torch.Tensor,
        threads: int | None = None,
    ) -> None:
        """The residual stream ``h`` (float32 [rows, hidden], contiguous) through every
        layer of a decode step, in place, in one call: per layer the RMS norms, the four
        matmuls, RoPE with the K/V write and attention (as ``attention``), the
        SiLU gate and the residual adds. ``shape``: the model's ``LlamaShape``;
        ``threads`` (default ``self.threads``): the kernel's own threads split the
        matmuls' columns and the attention's rows (the caller's thread is one of them)."""
        self._run_layers(self._layers, h, table, keys, values, shape, rope, positions, threads)

    def prefill_layers(
        self,
        h: torch.Tensor,
        table: ctypes.Array[OmniLayer],
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        slot: int,
        shape: Any,
        rope: torch.Tensor,
        positions: torch.Tensor,
        threads: int | None = None,
    ) -> None:
        """``decode_layers`` for a prefill chunk: the rows of ``h`` are one sequence's
        tokens at ``positions`` (ascending, int64), cached in ``slot`` of ``keys`` /
        ``values``; each attends to that slot's positions up to its own. A row gets the
        same bits as the decode step computing it would."""
        keys = [k[slot] for k in keys]
        values = [v[slot] for v in values]
        self._run_layers(
            self._prefill_layers, h, table, keys, values, shape, rope, positions, threads
        )

    def _run_layers(
        self,
        fn: Any,
        h: torch.Tensor,
        table: ctypes.Array[OmniLayer],
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        shape: Any,
        rope: torch.Tensor,
        positions: torch.Tensor,
        threads: int | None,
    ) -> None:
        if not all(t.is_contiguous() for t in (*keys, *values)):
            raise ValueError("the layers need contiguous caches")
        layers = len(table)
        key_ptrs = (ctypes.c_void_p * layers)(*(k.data_ptr() for k in keys))
        value_ptrs = (ctypes.c_void_p * layers)(*(v.data_ptr() for v in values))
        code = fn(
            h.data_ptr(),
            h.shape[0],
            layers,
            table,
            key_ptrs,
            value_ptrs,
            keys[0].shape[-2],
            shape.hidden,
            shape.heads,
            shape.kv_heads,
            shape.head_dim,
            shape.intermediate,
            shape.eps,
            rope.data_ptr(),
            positions.data_ptr(),
            self.threads if threads is None else threads,
        )
        if code != 0:
            raise MemoryError("the layers: no memory for their working buffers")


# (attn_norm, mlp_norm, [(packed, scale, lo) of qkv, o, gate_up, down])
LayerWeights = tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, ...]]]


def layer_table(layers: list[LayerWeights]) -> ctypes.Array[OmniLayer]:
    """The C table of every layer's weights, for ``Int4Kernel.decode_layers`` (the tensors must
    outlive it: the model holds them)."""
    table = (OmniLayer * len(layers))()
    for entry, (attn_norm, mlp_norm, linears) in zip(table, layers, strict=True):
        entry.attn_norm, entry.mlp_norm = attn_norm.data_ptr(), mlp_norm.data_ptr()
        for i, (w, scale, lo) in enumerate(linears):
            entry.w[i], entry.scale[i], entry.lo[i] = (
                w.data_ptr(),
                scale.data_ptr(),
                lo.data_ptr(),
            )
    return table


def fits_attention(head_dim: int, heads: int, kv_heads: int) -> bool:
    """Whether the attention takes this shape (MAX_HD and MAX_GROUP, and whole AVX512
    registers per head)."""
    return (
        head_dim % 16 == 0
        and head_dim <= MAX_HD
        and heads % kv_heads == 0
        and heads <= MAX_GROUP * kv_heads
    )


def _floats(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or not x.is_contiguous():
        return x.float().contiguous()
    return x


def _call(lib: ctypes.CDLL, prefix: str, ctx: int, name: str) -> Any:
    """The variant's function ``name``, its context bound as the first argument."""
    return functools.partial(getattr(lib, prefix + name), ctx)


@functools.cache
def load() -> Int4Kernel | str:
    """The best variant this CPU runs, or why none can."""
    why = []
    for variant in VARIANTS:
        kernel = load_variant(variant.name)
        if not isinstance(kernel, str):
            return kernel
        why.append(f"{variant.name}: {kernel}")
    lib = library()
    return lib if isinstance(lib, str) else "; ".join(why)


@functools.cache
def load_variant(name: str) -> Int4Kernel | str:
    """One variant, or why it cannot run here."""
    variant = next(v for v in VARIANTS if v.name == name)
    lib = library()
    if isinstance(lib, str):
        return lib
    missing = cpu_lacks(variant)
    if missing:
        return f"the CPU lacks {missing}"
    return Int4Kernel(lib, variant)
