"""A tiny Stable-Diffusion-shaped diffusers pipeline with random weights, for tests and
benchmarks: no package ships text-to-image weights and nothing may be downloaded.

Every part is real (UNet2DConditionModel, AutoencoderKL, CLIP text encoder and
tokenizer, DDIM scheduler), only small: ~350 KB on disk, built in a few seconds, a
64x64 image in well under a second on a CPU. The VAE has four blocks, so like a real
one it works on an 8x smaller latent grid (without that, attention over full-size
pixels makes 256x256 take minutes). The images are noise-like, but deterministic per
seed, which is what the tests check.
"""

from __future__ import annotations

import json
from pathlib import Path

# CLIP's BPE with single letters only: every word is spelled out letter by letter.
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
MAX_TOKENS = 32  # the text encoder's positions; prompts are truncated to this


def _write_tokenizer(directory: Path) -> tuple[Path, Path]:
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, "!": 2}
    for letter in _LETTERS:
        vocab[letter] = len(vocab)
        vocab[f"{letter}</w>"] = len(vocab)
    directory.mkdir(parents=True, exist_ok=True)
    vocab_path, merges_path = directory / "vocab.json", directory / "merges.txt"
    vocab_path.write_text(json.dumps(vocab))
    merges_path.write_text("#version: 0.2\n")
    return vocab_path, merges_path


def build_tiny_pipeline(directory: Path, seed: int = 0) -> Path:
    """Write the pipeline into ``directory`` (save_pretrained layout) and return it."""
    import torch
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16),
        layers_per_block=1,
        sample_size=8,  # latents 8x8: the native size is 64x64
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=2,
        norm_num_groups=4,
    )
    vae = AutoencoderKL(
        block_out_channels=(4, 4, 4, 4),
        layers_per_block=1,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        norm_num_groups=2,
        sample_size=64,
    )
    vocab_path, merges_path = _write_tokenizer(directory.parent / f"{directory.name}-vocab")
    tokenizer = CLIPTokenizer(
        str(vocab_path),
        str(merges_path),
        model_max_length=MAX_TOKENS,
        pad_token="<|endoftext|>",
    )
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=MAX_TOKENS,
            projection_dim=16,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(str(directory))
    return directory


if __name__ == "__main__":  # python -m tests.diffusion_tiny DIR
    import sys

    print(build_tiny_pipeline(Path(sys.argv[1])))
