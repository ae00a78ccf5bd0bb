"""The running batch's KV cache: one padded tensor per layer, rows joining and leaving.

Rows are left-padded to a common length so one forward pass decodes every running
sequence; the attention mask hides the padding and each row carries its own position
ids. A row joins after its own prefill (its cache is padded in), leaves by index
selection (its memory is freed at once), and columns that are padding in every row
are trimmed so the batch does not keep the shape of sequences that left.

``HfBatch`` drives a transformers model over it, behind the interface the worker uses
for either thinker (see ``slot_batch.SlotBatch`` for the fast one).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from transformers import DynamicCache


class HfBatch:
    """A transformers causal LM decoding the running batch (any model, CPU or GPU)."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self._model = model
        self._device = device
        self._cache_kw = cache_keyword(model)
        self._kv = KvBatch(self._cache_kw)
        self._staged: tuple[DynamicCache, int] | None = None
        self.prefill_cached = 0  # no prefix cache: every prompt is computed
        self.prefixes = None

    @property
    def rows(self) -> int:
        return self._kv.rows

    @property
    def positions(self) -> list[int]:
        return self._kv.positions

    def prefill(
        self, ids: list[int], replay: int = 0, labels: Mapping[int, int] | None = None
    ) -> torch.Tensor:
        """The next-token logits [vocab] of a prompt; ``admit`` makes it a row.

        ``replay`` is ignored: the whole prompt is one forward pass; so are ``labels``
        (no prefix cache to keep them)."""
        n = len(ids)
        cache = DynamicCache()
        out = self._model(
            input_ids=torch.tensor([ids], device=self._device),
            attention_mask=torch.ones(1, n, dtype=torch.long, device=self._device),
            position_ids=torch.arange(n, device=self._device).unsqueeze(0),
            use_cache=True,
            **{self._cache_kw: cache},
        )
        self._staged = (cache, n)
        return out.logits[0, -1]

    def remember(self, row: int, ids: list[int], label: int | None = None) -> None:
        """No prefix cache here: nothing is kept."""

    def admit(self, first_token: int) -> None:
        assert self._staged is not None
        cache, n = self._staged
        self._staged = None
        self._kv.add(cache, n, first_token)

    def decode(self) -> torch.Tensor:
        """Logits [rows, vocab] of the next token of every row."""
        return self._model(**self._kv.step_inputs()).logits[:, -1, :]

    def advance(self, tokens: list[int]) -> None:
        self._kv.advance(tokens)

    def keep(self, rows: list[int]) -> None:
        self._kv.keep(rows)

    def reset(self) -> None:
        self._kv = KvBatch(self._cache_kw)
        self._staged = None


def cache_keyword(model: Any) -> str:
    """transformers renamed forward(past_key_values=) to forward(cache=); use what the
    installed version takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class KvBatch:
    def __init__(self, cache_kw: str = "past_key_values") -> None:
        # The forward() keyword for the cache ("cache" in newer transformers).
        self._cache_kw = cache_kw
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [rows, length], 1 = real token
        self.positions: list[int] = []  # next position id of each row
        self.last_tokens: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.positions)

    @property
    def length(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def add(self, cache: DynamicCache, prompt_len: int, first_token: int) -> None:
        """Append a row from a single-sequence prefill cache of ``prompt_len`` tokens."""
        new_kv = _tensors(cache)
        device = new_kv[0][0].device
        new_mask = torch.ones(1, prompt_len, dtype=torch.long, device=device)
        if self.cache is None or self.mask is None:
            kv, mask = new_kv, new_mask
        else:
            old_kv, old_mask = _tensors(self.cache), self.mask
            length = max(old_mask.shape[1], prompt_len)
            old_kv, old_mask = _left_pad(old_kv, old_mask, length)
            new_kv, new_mask = _left_pad(new_kv, new_mask, length)
            kv = [
                (torch.cat([ok, nk], dim=0), torch.cat([ov, nv], dim=0))
                for (ok, ov), (nk, nv) in zip(old_kv, new_kv, strict=True)
            ]
            mask = torch.cat([old_mask, new_mask], dim=0)
        self.cache = DynamicCache(ddp_cache_data=kv)
        self.mask = mask
        self.positions.append(prompt_len)
        self.last_tokens.append(first_token)

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order); the others' cache is released."""
        if not rows:
            self.cache, self.mask = None, None
            self.positions, self.last_tokens = [], []
            return
        assert self.cache is not None and self.mask is not None
        index = torch.tensor(rows, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        # Columns that are padding for every remaining row are dead weight.
        used = torch.nonzero(mask.sum(dim=0) > 0)
        start = int(used[0]) if used.numel() else mask.shape[1]
        kv = [
            (k.index_select(0, index)[:, :, start:, :], v.index_select(0, index)[:, :, start:, :])
            for k, v in _tensors(self.cache)
        ]
        self.cache = DynamicCache(ddp_cache_data=kv)
        self.mask = mask[:, start:]
        self.positions = [self.positions[r] for r in rows]
        self.last_tokens = [self.last_tokens[r] for r in rows]

    def step_inputs(self) -> dict[str, object]:
        """Model inputs decoding one more token for every row."""
        assert self.mask is not None
        device = self.mask.device
        self.mask = torch.cat(
            [self.mask, torch.ones(self.rows, 1, dtype=self.mask.dtype, device=device)], dim=1
        )
        return {
            "input_ids": torch.tensor(self.last_tokens, device=device).unsqueeze(1),
            "attention_mask": self.mask,
            "position_ids": torch.tensor(self.positions, device=device).unsqueeze(1),
            self._cache_kw: self.cache,
            "use_cache": True,
        }

    def advance(self, tokens: list[int]) -> None:
        """Record the tokens just sampled (one per row)."""
        self.last_tokens = tokens
        self.positions = [p + 1 for p in self.positions]


def _tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _left_pad(
    kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, length: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    pad = length - mask.shape[1]
    if pad <= 0:
        return kv, mask
    padded = []
    for k, v in kv:
        zeros = k.new_zeros(k.shape[0], k.shape[1], pad, k.shape[3])
        padded.append((torch.cat([zeros, k], dim=2), torch.cat([zeros.clone(), v], dim=2)))
    return padded, torch.cat([mask.new_zeros(mask.shape[0], pad), mask], dim=1)
