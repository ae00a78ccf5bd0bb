"""Our CPU kernels (int4_kernel_*.c) against plain torch: the int4 matmul, RMS norm, the
SiLU gate and a decode step's attention with its RoPE and cache write; each variant's
tests skipped, saying why, on a CPU without its instructions or where the library was not
built (no C compiler at install). The library's interface against its header, the ABI
check at load, and the fallback to torch's kernel."""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from omnistage.config.engine_args import LlmArgs  # noqa: E402
from omnistage.engines.llm import backends, int4_abi, int4_kernel  # noqa: E402
from omnistage.engines.llm.int4_linear import Int4Linear  # noqa: E402
from omnistage.protocol.errors import EngineError  # noqa: E402

_KERNEL = int4_kernel.load_variant("avx512-vnni")
if not isinstance(_KERNEL, str) and not _KERNEL.fused:
    _KERNEL = "not the fused variant"
needs_kernel = pytest.mark.skipif(isinstance(_KERNEL, str), reason=f"no int4 kernel: {_KERNEL}")


def _runnable() -> list[str]:
    """The variants that load here: the CPU runs them and the install built the library
    (their matmuls are tested alike)."""
    return [v.name for v in int4_kernel.VARIANTS if not isinstance(_load(v.name), str)]


def _load(name: str) -> int4_kernel.Int4Kernel | str:
    return int4_kernel.load_variant(name)


def _quantized(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (0..15), scale and lo per group of 32, and the weights they stand for (with
    scale and lo rounded to float16 as the kernel keeps them)."""
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) * 0.05
    groups = w.reshape(n, k // 32, 32)
    lo = groups.amin(-1)
    scale = ((groups.amax(-1) - lo) / 15).clamp_min(1e-12)
    q = torch.round((groups - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15)
    exact = q * scale.half().float().unsqueeze(-1) + lo.half().float().unsqueeze(-1)
    return q.reshape(n, k), scale, lo, exact.reshape(n, k)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _variant_or_skip(name: str) -> Any:
    why = _load(name)
    return pytest.param(name, marks=pytest.mark.skipif(isinstance(why, str), reason=str(why)))


# A test each variant passes alike (skipped, saying why, for one that cannot run here).
EACH_VARIANT = pytest.mark.parametrize(
    "variant", [_variant_or_skip(v.name) for v in int4_kernel.VARIANTS]
)


@EACH_VARIANT
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (48, 64)])
def test_the_matmul_matches_the_dequantized_weights(
    variant: str, rows: int, n: int, k: int
) -> None:
    kernel = int4_kernel.load_variant(variant)
    assert not isinstance(kernel, str), kernel
    q, scale, lo, exact = _quantized(n, k)
    packed = kernel.pack(q, scale, lo)
    x = torch.randn(rows, k)
    reference = x.double() @ exact.double().T
    # Two int8 parts per activation: far closer than bfloat16 activations (~2e-3).
    assert _rel(kernel.matmul(x, packed, n), reference) < 1e-4
    # One part (the LM head's shortlist pass): ~8 bits.
    assert _rel(kernel.matmul(x, packed, n, coarse=True), reference) < 2e-2
    into = torch.randn(rows, n)
    before = into.clone()
    out = kernel.matmul(x, packed, n, into=into)
    assert out is into
    assert _rel(into - before, reference) < 1e-4


@EACH_VARIANT
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("n", [48, 960])
def test_the_matmul_on_a_team_of_threads_gives_the_same_bits(
    variant: str, rows: int, n: int
) -> None:
    kernel = _load(variant)
    assert not isinstance(kernel, str)
    q, scale, lo, _ = _quantized(n, 576)
    packed = kernel.pack(q, scale, lo)
    x = torch.randn(rows, 576)
    one = kernel.matmul(x, packed, n)
    into = torch.randn(rows, n)
    one_into = kernel.matmul(x, packed, n, into=into.clone(), coarse=True)
    try:
        for threads in (2, 3, 5):  # 48 columns: fewer units than 5 threads
            kernel.threads = threads
            assert torch.equal(kernel.matmul(x, packed, n), one)
            assert torch.equal(
                kernel.matmul(x, packed, n, into=into.clone(), coarse=True), one_into
            )
    finally:
        kernel.threads = 1


def test_the_variants_agree_to_float_rounding() -> None:
    kernels = [int4_kernel.load_variant(name) for name in _runnable()]
    if len(kernels) < 2:
        pytest.skip(f"one variant runs here ({_runnable()})")
    q, scale, lo, _ = _quantized(960, 576)
    x = torch.randn(5, 576)
    outs = [k.matmul(x, k.pack(q, scale, lo), 960) for k in kernels if not isinstance(k, str)]
    # The same integer sums; only the float accumulation's rounding may differ.
    assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_zero_row_and_a_constant_group_are_exact() -> None:
    assert not isinstance(_KERNEL, str)
    q, scale, lo, exact = _quantized(32, 64)
    x = torch.zeros(2, 64)
    x[1, :32] = 0.5  # one group all equal, the other all zero
    out = _KERNEL.matmul(x, _KERNEL.pack(q, scale, lo), 32)
    assert torch.equal(out[0], torch.zeros(32))
    assert torch.allclose(out[1], (x[1].double() @ exact.double().T).float(), atol=1e-5)


@EACH_VARIANT
def test_int4_linear_on_our_kernel_matches_torchs_within_bfloat16(variant: str) -> None:
    kernel = _load(variant)
    assert not isinstance(kernel, str)
    w = torch.randn(960, 576) * 0.05
    x = torch.randn(4, 576)
    ours, theirs = Int4Linear(w, kernel)(x), Int4Linear(w)(x)
    # The same grid; theirs rounds activations (and scales) to bfloat16.
    assert _rel(ours, theirs) < 1e-2


@EACH_VARIANT
def test_rms_norm_and_the_silu_gate_match_torch(variant: str) -> None:
    kernel = _load(variant)
    assert not isinstance(kernel, str)
    x, weight = torch.randn(3, 576) * 3, torch.rand(576) + 0.5
    expected = F.rms_norm(x, (576,), weight, 1e-5)
    assert torch.allclose(kernel.rms_norm(x, weight, 1e-5), expected, rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(3, 2 * 1536) * 6  # large |gate| too: e^-gate must not overflow
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    assert torch.allclose(kernel.silu_mul(gate_up), expected, rtol=1e-5, atol=1e-5)


@EACH_VARIANT
@pytest.mark.parametrize(("n", "k"), [(49152, 64), (1000, 1), (37, 37), (100, 17)])
def test_topk_indices_are_torchs_set(variant: str, n: int, k: int) -> None:
    kernel = _load(variant)
    assert not isinstance(kernel, str)
    x = torch.randn(5, n)  # no ties
    got = kernel.topk_indices(x, k)
    want = torch.topk(x, k, dim=-1, sorted=False).indices
    assert got.shape == (5, k) and got.dtype == torch.int64
    assert [set(r) for r in got.tolist()] == [set(r) for r in want.tolist()]


@EACH_VARIANT
def test_q8_dots_are_the_shortlists_float32_products_row_by_row(variant: str) -> None:
    kernel = _load(variant)
    assert not isinstance(kernel, str)
    gen = torch.Generator().manual_seed(3)
    vocab, k, rows, per_row = 300, 96, 5, 7
    q = torch.randint(-127, 128, (vocab, k // 32, 32), dtype=torch.int8, generator=gen)
    scale = torch.rand(vocab, k // 32, 1, generator=gen) / 50
    x = torch.randn(rows, k, generator=gen)
    ids = torch.randint(0, vocab, (rows, per_row), generator=gen)
    got = kernel.q8_dots(q, scale, x, ids)
    weights = (q.float() * scale).reshape(vocab, k)
    want = (weights[ids] @ x.unsqueeze(-1)).squeeze(-1)
    assert got.shape == (rows, per_row)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    # Each row on its own gives the same bits (a batch's rows do not change each other).
    alone = torch.cat([kernel.q8_dots(q, scale, x[i : i + 1], ids[i : i + 1]) for i in range(rows)])
    assert torch.equal(alone, got)


@EACH_VARIANT
def test_topk_indices_skip_nan_and_refuse_a_k_out_of_range(variant: str) -> None:
    kernel = _load(variant)
    assert not isinstance(kernel, str)
    x = torch.arange(40, dtype=torch.float32).repeat(2, 1)
    x[0, 39] = x[1, 0] = float("nan")  # the first value seeds the heap: NaN there too
    got = [set(r) for r in kernel.topk_indices(x, 3).tolist()]
    assert got == [{36, 37, 38}, {37, 38, 39}]
    for k in (0, 41):
        with pytest.raises(ValueError, match="top-k"):
            kernel.topk_indices(x, k)


def _rotated(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs (2i, 2i + 1) with cs [hd/2, 2] (cos, sin)."""
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cs[:, 0], cs[:, 1]
    return torch.stack([a * c - b * s, a * s + b * c], -1).reshape(x.shape)


def _attention_case(
    rows: int, capacity: int, heads: int = 9, kv: int = 3, hd: int = 64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches [rows, kv, capacity, hd] (keys, values), a q/k/v projection per row
    and a RoPE table [capacity, hd/2, 2]."""
    keys, values = torch.randn(rows, kv, capacity, hd), torch.randn(rows, kv, capacity, hd)
    angles = torch.rand(capacity, hd // 2) * 6
    rope = torch.view_as_real(torch.polar(torch.ones_like(angles), angles)).contiguous()
    return keys, values, torch.randn(rows, (heads + 2 * kv) * hd), rope


@EACH_VARIANT
@pytest.mark.parametrize("lengths", [[1], [37, 5, 130], [9, 16, 17]])
def test_a_decode_steps_attention_writes_the_cache_and_matches_sdpa(
    variant: str, lengths: list[int]
) -> None:
    kernel = _load(variant)
    assert not isinstance(kernel, str)
    heads, kv, hd, capacity = 9, 3, 64, 160
    keys, values, qkv, rope = _attention_case(len(lengths), capacity, heads, kv, hd)
    positions = torch.tensor([n - 1 for n in lengths])
    old_k, old_v = keys.clone(), values.clone()
    out = kernel.attention(qkv, positions, keys, values, heads, rope)
    for r, length in enumerate(lengths):
        p = length - 1
        q = _rotated(qkv[r, : heads * hd].reshape(heads, hd), rope[p])
        k_new = _rotated(qkv[r, heads * hd : (heads + kv) * hd].reshape(kv, hd), rope[p])
        v_new = qkv[r, (heads + kv) * hd :].reshape(kv, hd)
        assert torch.allclose(keys[r, :, p], k_new, atol=1e-6)
        assert torch.equal(values[r, :, p], v_new)
        # Nothing else in the cache moved.
        keys[r, :, p], values[r, :, p] = old_k[r, :, p], old_v[r, :, p]
        expected = F.scaled_dot_product_attention(
            q.view(kv, heads // kv, 1, hd),
            torch.cat([old_k[r, :, :p], k_new.unsqueeze(1)], 1).unsqueeze(1),
            torch.cat([old_v[r, :, :p], v_new.unsqueeze(1)], 1).unsqueeze(1),
        ).reshape(-1)
        assert torch.allclose(out[r], expected, atol=1e-5)
    assert torch.equal(keys, old_k) and torch.equal(values, old_v)


@EACH_VARIANT
def test_a_decode_rows_attention_is_the_same_bits_beside_other_rows(variant: str) -> None:
    # Torch's attention gives a row other bits in a batch (its mask and longest length)
    # than alone; a seeded sample would then depend on who else was decoding.
    kernel = _load(variant)
    assert not isinstance(kernel, str)
    lengths = [3, 70, 12, 41]
    keys, values, qkv, rope = _attention_case(len(lengths), 96)
    positions = torch.tensor([n - 1 for n in lengths])
    together = kernel.attention(qkv, positions, keys.clone(), values.clone(), 9, rope)
    for r in range(len(lengths)):
        alone = kernel.attention(
            qkv[r : r + 1],
            positions[r : r + 1],
            keys[r : r + 1].clone(),
            values[r : r + 1].clone(),
            9,
            rope,
        )
        assert torch.equal(together[r], alone[0])


@pytest.mark.skipif("avx2" not in _runnable(), reason="this CPU cannot run the avx2 variant")
@pytest.mark.parametrize(("start", "rows"), [(0, 1), (0, 23), (5, 9), (40, 30)])
def test_a_prefill_chunks_attention_gives_each_row_the_decode_steps_bits(
    start: int, rows: int
) -> None:
    # The AVX2 variant's prefill attends row by row in one slot: a row's output and the
    # K/V it caches are what the decode step computing it alone gives, so a retry that
    # prefills the tokens a first replica decoded goes on with the same bits.
    kernel = _load("avx2")
    assert not isinstance(kernel, str)
    keys, values, qkv, rope = _attention_case(3, 96)
    qkv = torch.randn(rows, qkv.shape[1])
    slot = 1
    positions = torch.arange(start, start + rows)
    k_pre, v_pre = keys.clone(), values.clone()
    out = kernel.attention(qkv, positions, k_pre, v_pre, 9, rope, slot)
    k_dec, v_dec = keys[slot : slot + 1].clone(), values[slot : slot + 1].clone()
    for i in range(rows):  # a decode step per token, in order
        row = kernel.attention(qkv[i : i + 1], positions[i : i + 1], k_dec, v_dec, 9, rope)
        assert torch.equal(out[i], row[0]), i
    assert torch.equal(k_pre[slot], k_dec[0]) and torch.equal(v_pre[slot], v_dec[0])
    # The other slots untouched.
    assert torch.equal(k_pre[0], keys[0]) and torch.equal(v_pre[2], values[2])


def test_the_engine_arg_picks_the_kernel(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert backends._int4_kernel("torch") is None
    monkeypatch.setattr(int4_kernel, "load", lambda: "the CPU lacks avx512vnni")
    with caplog.at_level(logging.WARNING, logger=backends.__name__):
        assert backends._int4_kernel("auto") is None  # torch's, with a warning
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "torch's kernel" in warned[0].getMessage()
    assert "the CPU lacks avx512vnni" in warned[0].getMessage()
    with pytest.raises(EngineError, match="the CPU lacks avx512vnni"):
        backends._int4_kernel("omnistage")
    monkeypatch.setattr(int4_kernel, "load_variant", lambda name: f"{name}: the CPU lacks it")
    with pytest.raises(EngineError, match="int4_kernel avx2 cannot run here: avx2: the CPU"):
        backends._int4_kernel("avx2")
    assert LlmArgs(int4_kernel="avx2").int4_kernel == "avx2"
    with pytest.raises(ValueError):
        LlmArgs(int4_kernel="fastest")


def _fresh_load() -> int4_kernel.Int4Kernel | str:
    caches = (int4_kernel.load, int4_kernel.load_variant, int4_abi.library)
    for cache in caches:
        cache.cache_clear()
    try:
        return int4_kernel.load()
    finally:
        for cache in caches:
            cache.cache_clear()


def _built() -> ctypes.CDLL:
    lib = int4_abi.library()
    if isinstance(lib, str):
        pytest.skip(lib)
    return lib


def test_a_cpu_without_the_instructions_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _built()
    lacks = {"avx512-vnni": "avx512bw, avx512vnni", "avx2": "avx2, f16c"}
    monkeypatch.setattr(int4_kernel, "cpu_lacks", lambda v: lacks[v.name])
    why = _fresh_load()
    assert why == (
        "avx512-vnni: the CPU lacks avx512bw, avx512vnni; avx2: the CPU lacks avx2, f16c"
    )


def test_a_cpu_with_avx2_only_gets_the_parts_not_the_one_call_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if "avx2" not in _runnable():
        pytest.skip("this CPU cannot run the avx2 variant")
    monkeypatch.setattr(int4_kernel, "cpu_lacks", lambda v: "avx512vnni" if v.fused else "")
    kernel = _fresh_load()
    assert not isinstance(kernel, str), kernel
    assert (kernel.variant, kernel.fused, kernel.label) == ("avx2", False, "int4-avx2")


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="no /proc/cpuinfo to compare")
def test_the_librarys_cpu_detection_agrees_with_the_kernels_cpuinfo() -> None:
    _built()
    text = Path("/proc/cpuinfo").read_text()
    flags = set(re.search(r"^flags\s*:(.*)$", text, re.M).group(1).split())  # type: ignore[union-attr]
    for variant in int4_kernel.VARIANTS:
        lacks = int4_abi.cpu_lacks(variant)
        named = {f.replace("avx512vnni", "avx512_vnni") for f in lacks.split(", ") if f}
        assert all(f not in flags for f in named), (variant.name, lacks)
        runs = not lacks
        assert runs == (not isinstance(_load(variant.name), str))
    vnni = int4_abi.cpu_lacks(int4_kernel.VARIANTS[0])
    assert ("avx512_vnni" in flags) == ("avx512vnni" not in vnni)


def test_an_unbuilt_library_is_named_and_leaves_torchs_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(int4_abi, "library_path", lambda: None)
    monkeypatch.setattr(int4_abi.platform, "machine", lambda: "x86_64")
    why = _fresh_load()
    assert isinstance(why, str) and "_int4_kernel is not built" in why
    assert "pip install -e ." in why
    monkeypatch.setattr(int4_abi.platform, "machine", lambda: "aarch64")
    assert _fresh_load() == "the kernels are written for x86-64 CPUs, not aarch64"


class _FakeLibrary:
    """Answers omni_abi as the real library would, but for ``wrong``."""

    def __init__(self, real: Any, wrong: dict[int, int]) -> None:
        self._real, self._wrong = real, wrong

    def omni_abi(self, question: int) -> int:
        return self._wrong.get(question, self._real.omni_abi(question))


def test_a_library_built_from_other_sources_is_refused() -> None:
    lib = _built()
    path = int4_abi.library_path()
    assert path is not None
    int4_abi.check_abi(lib, path)  # the real one agrees
    for question, answer, named in [
        (1, 64, "OMNI_GROUP 64 (here 32)"),
        (0, 99, f"OMNI_ABI_VERSION 99 (here {int4_abi.ABI_VERSION})"),
        (6, 120, "sizeof(omni_layer) 120"),
        (10, 56, "offsetof(omni_layer, scale) 56"),
    ]:
        with pytest.raises(int4_abi.KernelAbiError, match=re.escape(named)) as raised:
            int4_abi.check_abi(_FakeLibrary(lib, {question: answer}), path)
        assert "rebuild it (pip install -e .)" in str(raised.value)


_HEADER = Path(int4_abi.__file__).with_name("int4_kernel.h").read_text()
_C_TYPES = {"int": ctypes.c_int, "long": ctypes.c_long, "float": ctypes.c_float}


def _header_functions() -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """int4_kernel.h's exported functions: (result, arguments) as ctypes types, every
    pointer a void * and a char * a c_char_p (as the binding declares them)."""
    found = {}
    prototype = r"OMNI_API ([\w ]+?\**)\s*(omni_\w+)\(([^)]*)\);"
    for result, name, args in re.findall(prototype, _HEADER):
        types = []
        for arg in [a.strip() for a in args.split(",") if a.strip() not in ("", "void")]:
            if arg.startswith("char *"):
                types.append(ctypes.c_char_p)
            elif "*" in arg:
                types.append(ctypes.c_void_p)
            else:
                types.append(_C_TYPES[arg.split()[0]])
        ret = None if result == "void" else ctypes.c_void_p if "*" in result else _C_TYPES[result]
        found[name] = (ret, tuple(types))
    return found


def test_the_binding_declares_the_headers_functions_and_constants() -> None:
    assert _header_functions() == int4_abi.SIGNATURES
    constants = dict(re.findall(r"#define (OMNI_\w+) (\d+)", _HEADER))
    for name, (_, ours) in int4_abi.ABI_ANSWERS.items():
        if name.startswith("OMNI_"):
            assert int(constants[name]) == ours, name


def _tiny_model() -> tuple[Any, Any, list[Any], torch.Tensor]:
    """A 2-layer model of random int4 weights on our kernel: its shape, layer table,
    (norms, packed weights) per layer and RoPE table."""
    assert not isinstance(_KERNEL, str)
    from omnistage.engines.llm.fast_llama import LlamaShape

    shape = LlamaShape(2, 64, 4, 2, 16, 128, 100, 1e-5, 10000.0, 64)
    widths = [(96 + 32, 64), (64, 64), (256, 64), (64, 128)]  # qkv, o, gate_up, down
    layers, weights = [], []
    for _ in range(shape.layers):
        packs = [_KERNEL.pack(*_quantized(n, k)[:3]) for n, k in widths]
        norms = (torch.rand(64) + 0.5, torch.rand(64) + 0.5)
        layers.append((*norms, packs))
        weights.append((norms, packs))
    angles = torch.rand(64, 8) * 6
    rope = torch.view_as_real(torch.polar(torch.ones_like(angles), angles)).contiguous()
    return shape, int4_kernel.layer_table(layers), weights, rope


@needs_kernel
@pytest.mark.parametrize("rows", [1, 4, 7])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_prefill_chunk_in_one_call_gives_each_row_the_decode_steps_bits(
    rows: int, threads: int
) -> None:
    # The chunk's tokens in one slot, after 5 cached positions; on a team, a thread's
    # rows attend to K/V another thread's rows wrote.
    assert not isinstance(_KERNEL, str)
    shape, table, _, rope = _tiny_model()
    caches = [[torch.randn(2, 2, 32, 16) for _ in range(2)] for _ in range(2)]
    start, slot = 5, 1
    positions = torch.arange(start, start + rows)
    h0 = torch.randn(rows, 64)

    h = h0.clone()
    keys, values = [c[0].clone() for c in caches], [c[1].clone() for c in caches]
    _KERNEL.prefill_layers(h, table, keys, values, slot, shape, rope, positions, threads)

    k_ref, v_ref = [c[0].clone() for c in caches], [c[1].clone() for c in caches]
    one_k, one_v = [k[slot : slot + 1] for k in k_ref], [v[slot : slot + 1] for v in v_ref]
    expected = h0.clone()
    for i in range(rows):  # a decode step per token, in order
        row = expected[i : i + 1]
        _KERNEL.decode_layers(row, table, one_k, one_v, shape, rope, positions[i : i + 1], 1)
    assert torch.equal(h, expected)
    assert all(torch.equal(a, b) for a, b in zip(keys + values, k_ref + v_ref, strict=True))
    assert torch.equal(keys[0][0], caches[0][0][0])  # the other slot untouched


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_layers_in_one_call_is_the_per_op_decode(rows: int, threads: int) -> None:
    # On a team of threads too (each a share of every matmul's columns and of the
    # attention's rows, more threads than rows included): the same bits.
    assert not isinstance(_KERNEL, str)
    shape, table, weights, rope = _tiny_model()
    capacity = 32
    caches = [[torch.randn(rows, 2, capacity, 16) for _ in range(2)] for _ in range(2)]
    positions = torch.tensor([5 + 5 * r for r in range(rows)])  # < capacity
    h0 = torch.randn(rows, 64)

    h = h0.clone()
    keys, values = [c[0].clone() for c in caches], [c[1].clone() for c in caches]
    _KERNEL.decode_layers(h, table, keys, values, shape, rope, positions, threads)

    expected = h0.clone()
    k_ref, v_ref = [c[0].clone() for c in caches], [c[1].clone() for c in caches]
    for i, ((attn_norm, mlp_norm), (qkv, o, gate_up, down)) in enumerate(weights):
        x = _KERNEL.rms_norm(expected, attn_norm, shape.eps)
        qkv_out = _KERNEL.matmul(x, qkv, 128)
        attn = _KERNEL.attention(qkv_out, positions, k_ref[i], v_ref[i], 4, rope)
        _KERNEL.matmul(attn, o, 64, into=expected)
        x = _KERNEL.rms_norm(expected, mlp_norm, shape.eps)
        _KERNEL.matmul(_KERNEL.silu_mul(_KERNEL.matmul(x, gate_up, 256)), down, 64, into=expected)
    assert torch.equal(h, expected)
    assert all(torch.equal(a, b) for a, b in zip(keys + values, k_ref + v_ref, strict=True))


@needs_kernel
def test_a_forked_child_starts_a_team_of_its_own() -> None:
    # fork copies only the calling thread: a child that used the parent's team would
    # wait at the first barrier forever.
    assert not isinstance(_KERNEL, str)
    q, scale, lo, _ = _quantized(960, 576)
    packed = _KERNEL.pack(q, scale, lo)
    x = torch.randn(2, 576)
    try:
        _KERNEL.threads = 2
        expected = _KERNEL.matmul(x, packed, 960)  # the parent's team exists now
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only with the same bits, soon
            signal.alarm(20)
            os._exit(0 if torch.equal(_KERNEL.matmul(x, packed, 960), expected) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        _KERNEL.threads = 1


@needs_kernel
def test_contexts_are_independent_and_close_ends_their_teams() -> None:
    # Two kernels, each with its own buffers and team, stepping at once from two
    # threads: the bits of one step alone; closing one joins its team's threads.
    import threading

    assert not isinstance(_KERNEL, str)
    lib = int4_abi.library()
    assert not isinstance(lib, str)
    shape, table, _, rope = _tiny_model()
    caches = [[torch.randn(3, 2, 32, 16) for _ in range(2)] for _ in range(2)]
    positions = torch.tensor([4, 9, 30])
    h0 = torch.randn(3, 64)

    def step(kernel: int4_kernel.Int4Kernel, threads: int) -> tuple[torch.Tensor, list[Any]]:
        h, kv = h0.clone(), [t.clone() for c in caches for t in c]
        kernel.decode_layers(h, table, kv[0::2], kv[1::2], shape, rope, positions, threads)
        return h, kv

    alone = step(_KERNEL, 1)
    kernels = [int4_kernel.Int4Kernel(lib, int4_kernel.VARIANTS[0]) for _ in range(2)]
    results: list[Any] = [None, None]

    def run(i: int) -> None:
        results[i] = [step(kernels[i], 2) for _ in range(5)]

    workers = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    for kernel in kernels:
        kernel.close()
        kernel.close()  # a second close does nothing
    for got in [r for rs in results for r in rs]:
        assert torch.equal(got[0], alone[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], alone[1], strict=True))
