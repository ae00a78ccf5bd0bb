"""The thinker's int4 weights: a linear layer with its weights in 4 bits per weight, and
the tied embedding / LM head that keeps its GGUF tensor's 8-bit values beside an int4
copy for a fast first pass over the vocabulary. Each runs on our kernel
(``int4_kernel``) where given one, else on torch's CPU int4 kernel.
"""

from __future__ import annotations

import torch

from omnistage.engines.llm.int4_abi import GROUP
from omnistage.engines.llm.int4_kernel import Int4Kernel

_ROWS = 4096  # rows quantized at a time: bounds the float32 temporaries of a big matrix
_PARTS = ("w", "scale", "lo")  # our kernel's packed tensors (Int4Kernel.pack)


class Int4Linear:
    """y = x @ W.T with W in int4, asymmetric per group of 32 inputs (the Q4_1 grid),
    float32 in and out.

    Run by our kernel (``int4_kernel``, scales in float16, activations quantized to int8
    per group inside it) where given one, else by torch's CPU int4 kernel (scales and
    zero points in bfloat16, activations rounded to bfloat16 around it).
    """

    def __init__(
        self, weight: torch.Tensor, kernel: Int4Kernel | None = None, coarse: bool = False
    ) -> None:
        """``coarse``: our kernel may round activations to ~8 bits (a shortlist's pass)."""
        self._kernel = kernel
        self._coarse = coarse
        self.out_features = weight.shape[0]
        packed: list = []
        scales: list[torch.Tensor] = []
        for block in weight.split(_ROWS):
            n, k = block.shape
            groups = block.float().reshape(n, k // GROUP, GROUP)
            lo, hi = groups.amin(-1), groups.amax(-1)
            scale = ((hi - lo) / 15).clamp_min(1e-12)
            q = torch.round((groups - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, 15)
            q = q.to(torch.int32).reshape(n, k)
            if kernel is not None:
                packed.append(kernel.pack(q, scale, lo))
                continue
            packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            # The kernel computes (q - 8) * scale + zero.
            scales.append(torch.stack([scale, lo + 8 * scale], -1))
        if kernel is not None:
            # _ROWS is a multiple of the kernel's 16-column blocks: the blocks' bytes,
            # scales and lows simply follow one another.
            self.packed = tuple(torch.cat(part) for part in zip(*packed, strict=True))
        else:
            self.packed = torch.cat(packed)
            self.scales = torch.cat(scales).transpose(0, 1).contiguous().to(torch.bfloat16)

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        """The packed tensors by name (``packed_weights`` keeps them on disk)."""
        out = {f"{prefix}out": torch.tensor(self.out_features)}
        if self._kernel is not None:
            out.update({f"{prefix}{n}": t for n, t in zip(_PARTS, self.packed, strict=True)})
        else:
            out.update({f"{prefix}packed": self.packed, f"{prefix}scales": self.scales})
        return out

    @classmethod
    def restore(
        cls,
        state: dict[str, torch.Tensor],
        prefix: str,
        kernel: Int4Kernel | None = None,
        coarse: bool = False,
    ) -> Int4Linear:
        """The layer ``state(prefix)`` saved, for the same kernel layout."""
        self = cls.__new__(cls)
        self._kernel, self._coarse = kernel, coarse
        self.out_features = int(state[f"{prefix}out"])
        if kernel is not None:
            self.packed = tuple(state[f"{prefix}{n}"] for n in _PARTS)
        else:
            self.packed, self.scales = state[f"{prefix}packed"], state[f"{prefix}scales"]
        return self

    @property
    def nbytes(self) -> int:
        """Bytes a call reads: packed weights and their scales."""
        if self._kernel is not None:
            return sum(t.numel() * t.element_size() for t in self.packed)
        return self.packed.numel() + self.scales.numel() * 2

    def __call__(self, x: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T, or ``into`` += x @ W.T (``into`` contiguous)."""
        if self._kernel is not None:
            return self._kernel.matmul(x, self.packed, self.out_features, into, self._coarse)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, GROUP, self.scales
        ).float()
        return out if into is None else into.add_(out)


class TiedTable:
    """The tied embedding / LM head.

    Kept exactly as the GGUF ships it (Q8_0: int8 in groups of 32 with a scale each)
    for embedding lookups and exact logits, plus an int4 copy for a fast first pass
    over the vocabulary. That pass's bfloat16 logits are only good to ~0.1-0.5, enough to
    flip a greedy near-tie, so the ``REFINE`` best of every row are recomputed in float32
    from the exact rows: they decide greedy picks, top-k/top-p sampling and reported
    logprobs; the rest of the vocabulary keeps the first pass's values.
    """

    REFINE = 64

    def __init__(self, weight: torch.Tensor, kernel: Int4Kernel | None = None) -> None:
        k = weight.shape[1]
        q, scale = [], []
        for block in weight.split(_ROWS):
            groups = block.reshape(block.shape[0], k // GROUP, GROUP)
            gscale = (groups.abs().amax(-1) / 127).clamp_min(1e-12).unsqueeze(-1)
            q.append(torch.round(groups / gscale).to(torch.int8))
            scale.append(gscale)
        self._q = torch.cat(q)  # [rows, k/32, 32]
        self._scale = torch.cat(scale)  # [rows, k/32, 1]
        self._k = k
        self._coarse = Int4Linear(weight, kernel, coarse=True)
        self._kernel = kernel

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}q": self._q, f"{prefix}qscale": self._scale}
        return out | self._coarse.state(f"{prefix}coarse.")

    @classmethod
    def restore(
        cls, state: dict[str, torch.Tensor], prefix: str, kernel: Int4Kernel | None = None
    ) -> TiedTable:
        self = cls.__new__(cls)
        self._q, self._scale = state[f"{prefix}q"], state[f"{prefix}qscale"]
        self._k = self._q.shape[1] * self._q.shape[2]
        self._coarse = Int4Linear.restore(state, f"{prefix}coarse.", kernel, coarse=True)
        self._kernel = kernel
        return self

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Exact float32 rows."""
        return (self._q[ids].float() * self._scale[ids]).reshape(*ids.shape, self._k)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[n, vocab] float32 logits of float32 hidden states [n, hidden]."""
        logits = self._coarse(x)
        if self._kernel is not None:  # ~10x torch.topk's speed on one thread
            best = self._kernel.topk_indices(logits, self.REFINE)  # [n, R]
        else:
            best = torch.topk(logits, self.REFINE, dim=-1, sorted=False).indices
        if self._kernel is not None:
            exact = self._kernel.q8_dots(self._q, self._scale, x, best)
        else:
            exact = torch.bmm(self.rows(best), x.unsqueeze(-1)).squeeze(-1)
        return logits.scatter_(1, best, exact)
