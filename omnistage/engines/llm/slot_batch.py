"""The running batch of the fast thinker: a KV slot per sequence, rows 0..n-1 running.

Each layer's cache is one tensor ``[slots, kv_heads, capacity, head_dim]``; row i of
the batch lives in slot i from position 0, with its own length (an additive mask hides
what other rows have beyond it). A joining row is prefilled straight into the next free
slot; rows leaving are closed up by moving later rows down (one copy of their used
positions), so a step always works on a contiguous prefix and never gathers. Slots and
capacity grow in chunks as sequences need them and are kept until the batch empties.

Same interface as ``kv_batch.HfBatch``; the worker drives either.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from omnistage.engines.llm.fast_llama import FastLlama, cache_index
from omnistage.engines.llm.prefix_cache import ANSWER_GAP, PrefixCache, cuts

_CHUNK = 256  # capacity grows by this many positions
KEEP_BYTES = 256 << 20  # an emptied batch keeps a cache up to this size (see reset)


class SlotBatch:
    def __init__(
        self,
        model: FastLlama,
        max_rows: int,
        turn_ends: frozenset[int] = frozenset(),
        prefix_cache_tokens: int = 0,
        answers: bool = False,
    ) -> None:
        self._model = model
        self._max_rows = max_rows
        # Prompts are prefilled in chunks cut after these tokens (see prefix_cache).
        self._turn_ends = turn_ends
        self.prefixes = PrefixCache(prefix_cache_tokens, answers, turn_ends)
        self.prefill_cached = 0  # positions the last prefill took from the cache
        self.positions: list[int] = []  # next position (= cached length) of each row
        self.last_tokens: list[int] = []
        self._staged = 0  # prompt length prefilled into slot ``rows``, not yet admitted
        self._slots = 0
        self._capacity = 0
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []

    @property
    def rows(self) -> int:
        return len(self.positions)

    def prefill(
        self, ids: list[int], replay: int = 0, labels: Mapping[int, int] | None = None
    ) -> torch.Tensor:
        """The next-token logits [vocab] of a prompt, its cache written to the next free
        slot; ``admit`` makes it a row. ``labels``: prefix end -> the prefix key of the
        chat messages it holds (see prefix_labels), kept with the cached prefixes.

        ``replay``: that many last tokens go through the decode path one at a time, as
        a run that generated them computed them (a resumed seeded request: a batched
        prefill rounds differently, ~0.05 on the logits, enough to change a draw; on
        our kernels a short chunk gives the decode step's bits, a long one does not)."""
        n = len(ids)
        replay = min(replay, n - 1)
        self._reserve(self.rows + 1, n + 1)
        slot = self.rows
        first = n - replay
        chunk_ends = cuts(ids[:first], self._turn_ends)
        labels = labels or {}
        start = self.prefixes.restore(ids, chunk_ends, slot, self._keys, self._values, labels)
        self.prefill_cached = start
        # From a kept answer (one or two short of its cut), the rest of it goes with the
        # next chunk: a forward of a token or two costs a whole forward's fixed overhead.
        after = start + ANSWER_GAP if start and start not in chunk_ends else start
        for end in [*(c for c in chunk_ends if c > after), first]:
            logits = self._model.forward(
                torch.tensor(ids[start:end]),
                torch.arange(start, end),
                self._keys,
                self._values,
                prefill_slot=slot,
                prefill_start=start,
                head=end == first,
            )
            if end < first:
                self.prefixes.store(ids[:end], slot, self._keys, self._values, labels.get(end))
            start = end
        # The staged slot alone, as row 0 of a one-slot cache.
        keys = [k[slot : slot + 1] for k in self._keys]
        values = [v[slot : slot + 1] for v in self._values]
        for position in range(first, n):
            at = torch.tensor([position])
            logits = self._model.forward(
                torch.tensor([ids[position]]),
                at,
                keys,
                values,
                slots=cache_index(at, self._model.shape, self._capacity),
                length=position + 1,
            )
        self._staged = n
        assert logits is not None
        return logits[0]

    def remember(self, row: int, ids: list[int], label: int | None = None) -> None:
        """Keep the KV of ``row``, which holds ``ids`` (a prompt and its answer), for
        a later prompt that goes on from it (``label``: the key of those messages)."""
        if self.prefixes.answers:
            assert len(ids) <= self.positions[row], (len(ids), self.positions[row])
            self.prefixes.store(ids, row, self._keys, self._values, label)

    def admit(self, first_token: int) -> None:
        self.positions.append(self._staged)
        self.last_tokens.append(first_token)

    def use_threads(self, count: int) -> None:
        """Compute on ``count`` threads (the model decides whose: see FastLlama)."""
        self._model.use_threads(count)

    def decode(self) -> torch.Tensor:
        """Logits [rows, vocab] of the next token of every row."""
        length = max(self.positions) + 1
        self._reserve(self.rows, length)
        positions = torch.tensor(self.positions)
        if self._model.rows_attend_alone:  # each row's own positions: no mask, no slots
            return self._model.forward(
                torch.tensor(self.last_tokens), positions, self._keys, self._values
            )
        mask = None
        if self.rows > 1:
            mask = torch.zeros(self.rows, 1, 1, length)
            unused = torch.arange(length).unsqueeze(0) > positions.unsqueeze(1)
            mask.masked_fill_(unused.view(self.rows, 1, 1, length), float("-inf"))
        return self._model.forward(
            torch.tensor(self.last_tokens),
            positions,
            self._keys,
            self._values,
            slots=cache_index(positions, self._model.shape, self._capacity),
            mask=mask,
            length=length,
        )

    def advance(self, tokens: list[int]) -> None:
        """Record the tokens just sampled (one per row)."""
        self.last_tokens = tokens
        self.positions = [p + 1 for p in self.positions]

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (ascending), moved down to slots 0..len(rows)-1."""
        if not rows:
            self.reset()
            return
        assert rows == sorted(rows), rows
        for slot, row in enumerate(rows):
            if slot != row:
                used = self.positions[row]
                for k, v in zip(self._keys, self._values, strict=True):
                    k[slot, :, :used] = k[row, :, :used]
                    v[slot, :, :used] = v[row, :, :used]
        self.positions = [self.positions[r] for r in rows]
        self.last_tokens = [self.last_tokens[r] for r in rows]

    def reset(self) -> None:
        """Drop every row; the cache's memory too where it is larger than
        ``KEEP_BYTES``. A closed loop of clients empties the batch between their
        requests, and growing it back (zeroing and copying every layer's cache at 1, 2,
        4, 8 slots) took ~6% of an 8-client run; a cache kept whole is reused as it is
        (what a row reads is only what it wrote: see ``decode``)."""
        self.positions, self.last_tokens = [], []
        if self.cache_bytes() > KEEP_BYTES:
            self._keys, self._values, self._slots, self._capacity = [], [], 0, 0

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._keys, *self._values))

    def _reserve(self, slots: int, positions: int) -> None:
        if slots <= self._slots and positions <= self._capacity:
            return
        shape = self._model.shape
        # Slots double when rows need more of them, never with capacity: a conversation
        # of one row growing past a chunk copied its cache into 2, 4, then 8 slots
        # (~380 MB at 1024 positions: a 160 ms prefill in the middle of a voice turn).
        if slots > self._slots:
            slots = min(self._max_rows, max(slots, 2 * self._slots))
        else:
            slots = self._slots
        capacity = max(self._capacity, -(-positions // _CHUNK) * _CHUNK)
        size = (slots, shape.kv_heads, capacity, shape.head_dim)
        keys, values = [], []
        for i in range(shape.layers):
            k, v = torch.zeros(size), torch.zeros(size)
            if self._keys:
                k[: self._slots, :, : self._capacity] = self._keys[i]
                v[: self._slots, :, : self._capacity] = self._values[i]
            keys.append(k)
            values.append(v)
        self._keys, self._values = keys, values
        self._slots, self._capacity = slots, capacity
