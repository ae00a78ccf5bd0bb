"""A lean Llama forward for CPU decoding: 4-bit weights, a slot KV cache, few ops a step.

Decoding a 135M model one token at a time is bound by memory bandwidth and by per-op
overhead, not by arithmetic. fp32 weights are ~540 MB a token; these are ~85 MB:
every projection is int4 in groups of 32 along the input (the grid the Q4_1 GGUF
already ships, so re-quantizing it loses nothing but the scales' rounding), and the
tied embedding / LM head keeps its GGUF tensor's Q8_0 values (both in ``int4_linear``).
The int4 matmuls run on our kernel where the CPU has AVX512-VNNI or AVX2
(``int4_kernel``: int8 activations per group, ~2x torch's at one row, ~3x at eight),
else on torch's (bfloat16 activations); with AVX512-VNNI a decode step's layers are one
call into it. The residual stream, norms, RoPE, attention and the logits stay float32.
Per layer a step is ~20 ops: q/k/v and gate/up are one matmul each, RoPE is one complex
multiply (q/k rows are permuted at load so each head's rotated halves are interleaved
pairs; q.k is unchanged under the same permutation of both).

The KV cache and the running batch are ``slot_batch.SlotBatch``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from omnistage.engines.llm.attention import Attend, Attention, by_row
from omnistage.engines.llm.int4_abi import GROUP
from omnistage.engines.llm.int4_kernel import Int4Kernel, layer_table
from omnistage.engines.llm.int4_linear import Int4Linear, TiedTable
from omnistage.engines.llm.packed_weights import State, Tensors, cache_file, load_or_pack
from omnistage.engines.torch_threads import use_threads


@dataclass(frozen=True)
class LlamaShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    rope_theta: float
    max_positions: int

    @classmethod
    def of(cls, config: dict) -> LlamaShape:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        rope = config.get("rope_parameters") or {}
        return cls(
            layers=int(config["num_hidden_layers"]),
            hidden=hidden,
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0),
            max_positions=int(config.get("max_position_embeddings") or 2048),
        )


def supported(config: dict) -> str | None:
    """Why the fast path cannot run this model (None: it can)."""
    if config.get("model_type") != "llama":
        return f"model_type {config.get('model_type')!r} is not llama"
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type") or "default") != "default":
        return "scaled RoPE"
    if config.get("attention_bias") or config.get("mlp_bias"):
        return "biases"
    if config.get("hidden_act", "silu") != "silu":
        return f"activation {config.get('hidden_act')!r}"
    shape = LlamaShape.of(config)
    if shape.hidden % GROUP or shape.intermediate % GROUP:
        return f"dimensions not a multiple of {GROUP}"
    return None


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    qkv: Int4Linear
    o: Int4Linear
    mlp_norm: torch.Tensor
    gate_up: Int4Linear
    down: Int4Linear


def _packed(directory: Path, s: LlamaShape, kernel: Int4Kernel | None) -> State:
    """A checkpoint's weights quantized and packed for ``kernel``, by name."""
    t = Tensors(directory)
    state = TiedTable(t["embed_tokens.weight"], kernel).state("embed.")
    if "lm_head.weight" in t:  # else tied to the embedding
        state |= TiedTable(t["lm_head.weight"], kernel).state("head.")
    state["norm"] = t["norm.weight"]
    for i in range(s.layers):
        p = f"layers.{i}."
        q = _interleave_rope_rows(t[p + "self_attn.q_proj.weight"], s.heads, s.head_dim)
        k = _interleave_rope_rows(t[p + "self_attn.k_proj.weight"], s.kv_heads, s.head_dim)
        v = t[p + "self_attn.v_proj.weight"]
        gate, up = t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]
        state[p + "attn_norm"] = t[p + "input_layernorm.weight"]
        state[p + "mlp_norm"] = t[p + "post_attention_layernorm.weight"]
        state |= Int4Linear(torch.cat([q, k, v]), kernel).state(p + "qkv.")
        state |= Int4Linear(t[p + "self_attn.o_proj.weight"], kernel).state(p + "o.")
        state |= Int4Linear(torch.cat([gate, up]), kernel).state(p + "gate_up.")
        state |= Int4Linear(t[p + "mlp.down_proj.weight"], kernel).state(p + "down.")
    return state


def _interleave_rope_rows(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Rows of a q/k projection reordered so RoPE's rotated halves (i, i + d/2) become
    adjacent pairs (2i, 2i + 1) in every head."""
    half = head_dim // 2
    order = torch.stack([torch.arange(half), torch.arange(half) + half], 1).reshape(-1)
    return w.reshape(heads, head_dim, -1)[:, order].reshape(heads * head_dim, -1)


class FastLlama:
    """Weights and forward passes; the KV cache is the caller's."""

    def __init__(
        self,
        directory: Path,
        kernel: Int4Kernel | None = None,
        cache_dir: str | None = None,
        cache: bool = True,
    ) -> None:
        """``kernel``: our int4 kernel (None: torch's). ``cache``: keep the packed weights
        in ``cache_dir`` (see ``packed_weights``), and map them from there next time."""
        config = json.loads((directory / "config.json").read_text())
        # What the replica reports it runs on: "int4-avx512vnni", "int4-avx2" or "torch".
        self.kernel = kernel.label if kernel is not None else "torch"
        self.config = config
        self.shape = s = LlamaShape.of(config)

        def pack() -> State:
            return _packed(directory, s, kernel)

        if cache:
            path = cache_file(directory, self.kernel, cache_dir)
            state, self.weights_from = load_or_pack(path, pack)
        else:
            state, self.weights_from = pack(), "packed"
        self.embed = TiedTable.restore(state, "embed.", kernel)
        self.head = TiedTable.restore(state, "head.", kernel) if "head.q" in state else self.embed
        self.norm = state["norm"]
        self.layers = []
        for i in range(s.layers):
            p = f"layers.{i}."
            self.layers.append(
                _Layer(
                    attn_norm=state[p + "attn_norm"],
                    qkv=Int4Linear.restore(state, p + "qkv.", kernel),
                    o=Int4Linear.restore(state, p + "o.", kernel),
                    mlp_norm=state[p + "mlp_norm"],
                    gate_up=Int4Linear.restore(state, p + "gate_up.", kernel),
                    down=Int4Linear.restore(state, p + "down.", kernel),
                )
            )
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2).float() / s.head_dim))
        angles = torch.outer(torch.arange(s.max_positions).float(), inv)
        self.rope = torch.polar(torch.ones_like(angles), angles)  # [positions, head_dim/2]
        # Our kernels run a decode step's layers in one call (see ``_decode_fused``)
        # where the variant has them and the shape fits: then there is a layer table.
        self._kernel = kernel
        self._attention = Attention(s, self.rope, kernel)
        self._rope_cs = self._attention.rope_cs
        self._norm, self._gate = self._row_ops()
        self._layer_table = None
        if kernel is not None and kernel.fused and self._attention.on_kernel:
            self._layer_table = layer_table(
                [
                    (
                        layer.attn_norm,
                        layer.mlp_norm,
                        [lin.packed for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)],
                    )
                    for layer in self.layers
                ]
            )

    @property
    def fused_decode(self) -> bool:
        """Whether a decode step is one call into our kernels (``_decode_fused``)."""
        return self._layer_table is not None

    @property
    def rows_attend_alone(self) -> bool:
        """Whether a decode step's attention is our kernel's, which reads each row's own
        positions (``forward`` then needs no ``slots``, ``mask`` or ``length``)."""
        return self._attention.on_kernel

    def use_threads(self, count: int) -> None:
        """Compute on ``count`` threads. On our kernels they are the kernel's own (the
        fused variant's whole step, any variant's matmuls), and torch's few ops around
        them run on one thread: torch's OpenMP helpers spin after each op (the llm
        engine wants that, see ``engines.SPINNING_ENGINES``) and would take the core our
        second thread needs (measured in the engine: a step's layers 5.6 ms on two
        threads beside a spinning helper, 3.3 without it, 6.3 on one). Otherwise they
        are torch's."""
        if self._kernel is not None:
            self._kernel.threads = count
            use_threads(1)
        else:
            use_threads(count)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        slots: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        length: int = 0,
        prefill_slot: int | None = None,
        prefill_start: int = 0,
        head: bool = True,
    ) -> torch.Tensor | None:
        """Float32 logits [rows, vocab] for the last token of each row (None without
        ``head``: a prompt's chunk that only fills the cache).

        ``keys``/``values``: per layer ``[slots, kv_heads, capacity, head_dim]``.
        Decode: ``ids``/``positions`` are [rows], one new token per row (row i is slot
        i); ``slots`` [rows * kv_heads] says where their K/V go in a cache viewed as
        ``[-1, head_dim]`` (``cache_index``); attention reads each slot's first
        ``length`` positions, and ``mask`` [rows, 1, 1, length] (additive; None for one
        row) hides a row's unused ones (none of the three is read where
        ``rows_attend_alone``). Prefill: ``ids`` are one sequence's [n] tokens
        from position ``prefill_start`` (the slot ``prefill_slot`` holds the ones
        before), cached there; logits of the last one only.
        """
        if self.fused_decode and prefill_slot is None:
            return self._decode_fused(ids, positions, keys, values, head)
        if self.fused_decode and by_row(ids.shape[0], prefill_start):
            assert prefill_slot is not None
            return self._prefill_fused(ids, positions, keys, values, prefill_slot, head)
        h = self.embed.rows(ids)  # [n, hidden] float32
        if prefill_slot is not None:
            attend = self._attention.prefill(positions, prefill_slot, prefill_start)
        else:
            attend = self._attention.decode(positions, slots, mask, length)
        self._layers_by_ops(h, keys, values, attend)
        if not head:
            return None
        last = h if prefill_slot is None else h[-1:]
        return self.head.logits(self._norm(last, self.norm))

    def _layers_by_ops(
        self,
        h: torch.Tensor,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        attend: Attend,
    ) -> None:
        """The residual stream ``h`` [n, hidden] through every layer, in place, an op
        at a time; ``attend`` caches a layer's K/V and attends."""
        norm, gate = self._norm, self._gate
        for layer, layer_k, layer_v in zip(self.layers, keys, values, strict=True):
            attn = attend(layer.qkv(norm(h, layer.attn_norm)), layer_k, layer_v)
            layer.o(attn, into=h)  # the residual added in place
            x = norm(h, layer.mlp_norm)
            layer.down(gate(layer.gate_up(x)), into=h)

    def _row_ops(
        self,
    ) -> tuple[
        Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        Callable[[torch.Tensor], torch.Tensor],
    ]:
        """RMS norm and the SiLU gate for ``forward``'s per-op path: our kernel's (as the
        fused decode step uses), else torch's. Torch's are several ops each, on one
        thread beside the fused variant (``use_threads``); a 23-token prefill spent ~5 ms
        of its ~47 in torch's RMS norms alone."""
        s, kernel = self.shape, self._kernel
        if kernel is not None:
            return (lambda x, w: kernel.rms_norm(x, w, s.eps)), kernel.silu_mul

        def silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up

        return (lambda x, w: F.rms_norm(x, (s.hidden,), w, s.eps)), silu_gate

    def _decode_fused(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        head: bool,
    ) -> torch.Tensor | None:
        """``forward``'s decode on our kernels: every layer in one call (see
        ``Int4Kernel.decode_layers``); ``forward``'s ``slots``/``mask``/``length`` follow
        from ``positions`` (row i is slot i and sees positions 0..positions[i])."""
        kernel, s = self._kernel, self.shape
        assert kernel is not None and self._layer_table is not None
        h = self.embed.rows(ids).contiguous()  # [n, hidden] float32
        at = positions.to(torch.int64).contiguous()
        kernel.decode_layers(h, self._layer_table, keys, values, s, self._rope_cs, at)
        if not head:
            return None
        return self.head.logits(kernel.rms_norm(h, self.norm, s.eps))

    def _prefill_fused(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        slot: int,
        head: bool,
    ) -> torch.Tensor | None:
        """``forward``'s prefill of a short chunk on our kernels: every layer in one call
        (see ``Int4Kernel.prefill_layers``), each row as a decode step computes it."""
        kernel, s = self._kernel, self.shape
        assert kernel is not None and self._layer_table is not None
        h = self.embed.rows(ids).contiguous()
        at = positions.to(torch.int64).contiguous()
        kernel.prefill_layers(h, self._layer_table, keys, values, slot, s, self._rope_cs, at)
        if not head:
            return None
        return self.head.logits(kernel.rms_norm(h[-1:], self.norm, s.eps))


def cache_index(positions: torch.Tensor, shape: LlamaShape, capacity: int) -> torch.Tensor:
    """Where row i's K/V at ``positions[i]`` go in a ``[slots, kv_heads, capacity,
    head_dim]`` cache viewed as ``[-1, head_dim]`` (row i is slot i)."""
    rows = torch.arange(positions.shape[0]).unsqueeze(1)
    heads = torch.arange(shape.kv_heads).unsqueeze(0)
    return ((rows * shape.kv_heads + heads) * capacity + positions.unsqueeze(1)).reshape(-1)
