"""The attention of ``fast_llama``'s per-op forward (a prefill chunk; a decode step where
our kernel has no whole step in one call): our kernel's, row by row, or torch's.

Torch's attention gives a row other bits in a prefill chunk than in the decode step that
computes it alone, and other bits again beside other rows of a batch (its blocked
products and masks). Greedy output hardly notices; a seeded sample does: a request that
a retry resumes (its delivered tokens prefilled, not decoded as the first replica did)
drew other tokens after the cut. Our kernel's attention computes each row on its own,
over its own positions, in one order: the same bits wherever the row is. It is used
wherever the kernel runs and the shape fits, except for a long prefill chunk, where
torch's blocked products beat attending row by row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from omnistage.engines.llm.int4_kernel import Int4Kernel, fits_attention

# A prefill chunk of n tokens from position p attends row by row on our kernels (each row
# as a decode step computes it) while n * (p + n) is at most this; a bigger one through
# torch's attention, whose blocked products beat attending row by row there. Short
# chunks (a chat turn) spent more in torch's ops between the matmuls, and in waking the
# kernel's threads for each, than in the matmuls.
ROW_PREFILL_CELLS = 256 * 256

# A layer's attention: (its q/k/v projection [n, width], the layer's K and V caches
# [slots, kv_heads, capacity, head_dim]) -> the attention's output [n, heads * head_dim],
# with the rows' K/V written into the caches.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _Shape(Protocol):
    heads: int
    kv_heads: int
    head_dim: int


def by_row(n: int, start: int) -> bool:
    """Whether a prefill chunk of ``n`` tokens from ``start`` attends row by row."""
    return n * (start + n) <= ROW_PREFILL_CELLS


class Attention:
    """A model's attention for one forward: ``prefill`` or ``decode`` makes a layer's
    ``Attend`` (RoPE, the K/V write and the attention)."""

    def __init__(self, shape: _Shape, rope: torch.Tensor, kernel: Int4Kernel | None) -> None:
        """``rope``: complex [positions, head_dim/2] (q/k rows permuted at load so a head's
        rotated halves are adjacent pairs, see fast_llama)."""
        self._shape = shape
        self._rope = rope
        self._rope_cs = torch.view_as_real(rope).contiguous()  # [positions, hd/2, 2]
        self._kernel = (
            kernel
            if kernel is not None and fits_attention(shape.head_dim, shape.heads, shape.kv_heads)
            else None
        )

    @property
    def on_kernel(self) -> bool:
        """Whether a decode step attends on our kernel, which reads each row's own
        positions (``decode`` then ignores ``slots``, ``mask`` and ``length``)."""
        return self._kernel is not None

    @property
    def rope_cs(self) -> torch.Tensor:
        """The RoPE table as our kernels read it: [positions, hd/2, 2] (cos, sin)."""
        return self._rope_cs

    def prefill(self, positions: torch.Tensor, slot: int, start: int) -> Attend:
        """A prefill chunk's: one sequence's tokens at ``positions`` (from ``start``),
        cached in ``slot``, each attending to the slot's positions up to its own."""
        if self._kernel is not None and by_row(positions.shape[0], start):
            return self._on_kernel(positions, slot)
        n = positions.shape[0]
        rot = self._rope[positions].unsqueeze(1)  # [n, 1, head_dim/2]
        mask = None
        if start:
            # Causal within the chunk, everything before it visible.
            mask = torch.ones(n, start + n, dtype=torch.bool).tril(start)

        def attend(qkv: torch.Tensor, layer_k: torch.Tensor, layer_v: torch.Tensor) -> torch.Tensor:
            q, k, v = self._rotated(qkv, rot)
            return _prefill(q, k, v, layer_k, layer_v, slot, start, mask)

        return attend

    def decode(
        self,
        positions: torch.Tensor,
        slots: torch.Tensor | None,
        mask: torch.Tensor | None,
        length: int,
    ) -> Attend:
        """A decode step's: one new token per row (row i in slot i, at
        ``positions[i]``). Torch's: ``slots`` [rows * kv_heads] where their K/V go in a
        cache viewed as ``[-1, head_dim]``, attending to each slot's first ``length``
        positions under ``mask`` [rows, 1, 1, length] (additive; None for one row)."""
        if self._kernel is not None:
            return self._on_kernel(positions, None)
        assert slots is not None
        s, n = self._shape, positions.shape[0]
        rot = self._rope[positions].unsqueeze(1)  # [n, 1, head_dim/2]

        def attend(qkv: torch.Tensor, layer_k: torch.Tensor, layer_v: torch.Tensor) -> torch.Tensor:
            q, k, v = self._rotated(qkv, rot)
            layer_k.view(-1, s.head_dim).index_copy_(0, slots, k.reshape(-1, s.head_dim))
            layer_v.view(-1, s.head_dim).index_copy_(0, slots, v.reshape(-1, s.head_dim))
            # One new token per row: the query heads sharing a KV head act as that
            # head's queries, so attention needs no GQA expansion.
            q = q.view(n, s.kv_heads, s.heads // s.kv_heads, s.head_dim)
            return F.scaled_dot_product_attention(
                q, layer_k[:n, :, :length], layer_v[:n, :, :length], attn_mask=mask
            ).reshape(n, -1)

        return attend

    def _on_kernel(self, positions: torch.Tensor, slot: int | None) -> Attend:
        """Our kernel's: a decode step's rows (``slot`` None) or a prefill chunk's."""
        kernel, heads, rope = self._kernel, self._shape.heads, self._rope_cs
        assert kernel is not None
        at = positions.to(torch.int64).contiguous()

        def attend(qkv: torch.Tensor, layer_k: torch.Tensor, layer_v: torch.Tensor) -> torch.Tensor:
            return kernel.attention(qkv, at, layer_k, layer_v, heads, rope, slot)

        return attend

    def _rotated(
        self, qkv: torch.Tensor, rot: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [n, heads, hd] and k [n, kv_heads, hd] with RoPE (``rot`` [n, 1, hd/2]),
        and v [n, kv_heads, hd], of the q/k/v projection ``qkv`` [n, width]."""
        s, n = self._shape, qkv.shape[0]
        qk_width = (s.heads + s.kv_heads) * s.head_dim
        pairs = qkv[:, :qk_width].reshape(n, -1, s.head_dim // 2, 2)
        qk = torch.view_as_real(torch.view_as_complex(pairs) * rot)
        q = qk[:, : s.heads].reshape(n, s.heads, s.head_dim)
        k = qk[:, s.heads :].reshape(n, s.kv_heads, s.head_dim)
        return q, k, qkv[:, qk_width:].view(n, s.kv_heads, s.head_dim)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_k: torch.Tensor,
    layer_v: torch.Tensor,
    slot: int,
    start: int,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Torch's causal attention of one sequence's [n] tokens from position ``start`` over
    the slot's cache, caching their K/V (``mask``: the chunk's [n, start + n] causal
    mask; None from position 0)."""
    n = q.shape[0]
    end = start + n
    layer_k[slot, :, start:end] = k.transpose(0, 1)
    layer_v[slot, :, start:end] = v.transpose(0, 1)
    attn = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        layer_k[slot : slot + 1, :, :end],
        layer_v[slot : slot + 1, :, :end],
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=True,
    )
    return attn[0].transpose(0, 1).reshape(n, -1)
