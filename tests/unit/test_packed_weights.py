"""The fast backend's packed weights are kept on disk: a second load maps them and
computes the same bits as packing afresh, replicas that start together pack once, a
changed checkpoint is packed again, and a cache that cannot be written only costs time.
On a tiny random-weight Llama checkpoint, with torch's int4 kernel and each of ours."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omnistage.engines.llm.fast_llama import FastLlama
from omnistage.engines.llm.packed_weights import cache_file
from tests import int4_kernels


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    directory = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def _outputs(model: FastLlama) -> list[torch.Tensor]:
    x = torch.randn(3, model.shape.hidden, generator=torch.Generator().manual_seed(1))
    out = [model.embed.logits(x.clone()), model.embed.rows(torch.tensor([0, 7, 255]))]
    for layer in model.layers:
        out += [layer.qkv(x), layer.o(x), layer.gate_up(x), layer.attn_norm, layer.mlp_norm]
    return out


@pytest.mark.parametrize("kernel", int4_kernels.usable())
def test_a_second_load_maps_the_packed_file_and_computes_the_same_bits(
    checkpoint: Path, tmp_path: Path, kernel: str
) -> None:
    first = FastLlama(checkpoint, int4_kernels.load(kernel), str(tmp_path))
    again = FastLlama(checkpoint, int4_kernels.load(kernel), str(tmp_path))
    fresh = FastLlama(checkpoint, int4_kernels.load(kernel), cache=False)
    assert (first.weights_from, again.weights_from) == ("packed", "mapped")
    assert cache_file(checkpoint, again.kernel, str(tmp_path)).exists()
    for a, b, c in zip(_outputs(first), _outputs(again), _outputs(fresh), strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)


def test_replicas_that_start_together_pack_once(checkpoint: Path, tmp_path: Path) -> None:
    script = (
        "import sys; from pathlib import Path\n"
        "from omnistage.engines.llm.fast_llama import FastLlama\n"
        "print(FastLlama(Path(sys.argv[1]), None, sys.argv[2]).weights_from)\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(checkpoint), str(tmp_path)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    said = sorted(p.communicate(timeout=120)[0].strip() for p in procs)
    assert said == ["mapped", "packed"]


def test_a_changed_checkpoint_is_packed_again(checkpoint: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in checkpoint.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    before = cache_file(copy, "torch", str(tmp_path))
    assert FastLlama(copy, None, str(tmp_path)).weights_from == "packed"
    weights = next(copy.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert cache_file(copy, "torch", str(tmp_path)) != before
    assert FastLlama(copy, None, str(tmp_path)).weights_from == "packed"


def test_a_cache_that_cannot_be_written_only_costs_the_packing(
    checkpoint: Path, tmp_path: Path
) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the cache directory would be")
    model = FastLlama(checkpoint, None, str(blocked))
    assert model.weights_from.startswith("packed (not cached:")
    fresh = FastLlama(checkpoint, None, cache=False)
    assert all(torch.equal(a, b) for a, b in zip(_outputs(model), _outputs(fresh), strict=True))


def test_a_torn_cache_file_is_packed_again(checkpoint: Path, tmp_path: Path) -> None:
    path = cache_file(checkpoint, "torch", str(tmp_path))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"half a file")
    assert FastLlama(checkpoint, None, str(tmp_path)).weights_from == "packed"
    assert FastLlama(checkpoint, None, str(tmp_path)).weights_from == "mapped"
