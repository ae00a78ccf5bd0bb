"""A tiny Wan text-to-video diffusers pipeline with random weights, for tests and
benchmarks: no package ships video weights and nothing may be downloaded.

Every part is real (WanTransformer3DModel, AutoencoderKLWan, a T5 encoder, a fast
tokenizer, the flow-matching Euler scheduler), only small, with the configs diffusers'
own Wan tests use: well under 1 MB on disk, built in about a second, 9 frames of 64x64 in
a fraction of a second on a CPU. Like a real Wan model it works on latents 8x smaller in
space (sides must be multiples of 16 with its 2x2 patches) and 4x shorter in time (a
video has 4k+1 frames). The frames are noise-like, but deterministic per seed, which is
what the tests check.
"""

from __future__ import annotations

import string
from pathlib import Path

# The tokenizer spells every word out character by character.
_CHARS = string.ascii_lowercase + string.digits + ".,!?'-"
MAX_TOKENS = 64  # prompts are truncated to this (Wan's default is 512)


def _tokenizer() -> object:
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for char in _CHARS:
        vocab[char] = len(vocab)
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("."), "isolated")]
    )
    # T5's way: an end-of-sequence token after the text.
    core.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=MAX_TOKENS,
    )


def _parts(seed: int, in_channels: int = 16, image_dim: int | None = None) -> dict[str, object]:
    """What every tiny Wan pipeline has: VAE, text encoder and tokenizer, scheduler, and
    a transformer (which takes image latents and embeddings beside the noise in i2v)."""
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tokenizer = _tokenizer()
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),  # type: ignore[arg-type]
            d_model=32,
            d_kv=8,
            d_ff=32,
            num_layers=1,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    )
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=in_channels,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        # Rotary positions per axis, in patches: up to 256 frames and 1024-pixel sides.
        rope_max_seq_len=64,
        image_dim=image_dim,
    )
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )
    return {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "vae": vae,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0),
        "transformer": transformer,
    }


def build_tiny_video_pipeline(directory: Path, seed: int = 0) -> Path:
    """Write the text-to-video pipeline into ``directory`` (save_pretrained layout)."""
    from diffusers import WanPipeline

    WanPipeline(**_parts(seed)).save_pretrained(str(directory))  # type: ignore[arg-type]
    return directory


def build_tiny_i2v_pipeline(directory: Path, seed: int = 0) -> Path:
    """The image-to-video one (Wan 2.1 I2V's shape: a CLIP image encoder, and the first
    frame's latents as 20 more input channels), into ``directory``."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPVisionConfig, CLIPVisionModel

    try:  # transformers 5 without torchvision: the Pillow processor, said outright
        from transformers import CLIPImageProcessorPil as CLIPImageProcessor
    except ImportError:
        from transformers import CLIPImageProcessor  # type: ignore[assignment]

    parts = _parts(seed, in_channels=36, image_dim=4)
    image_encoder = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=4,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            intermediate_size=16,
            patch_size=1,
        )
    )
    pipe = WanImageToVideoPipeline(
        image_encoder=image_encoder,
        image_processor=CLIPImageProcessor(crop_size=32, size=32),
        **parts,  # type: ignore[arg-type]
    )
    pipe.save_pretrained(str(directory))
    return directory


if __name__ == "__main__":  # python -m tests.video_tiny DIR
    import sys

    print(build_tiny_video_pipeline(Path(sys.argv[1])))
    if len(sys.argv) > 2:  # python -m tests.video_tiny DIR I2V_DIR
        print(build_tiny_i2v_pipeline(Path(sys.argv[2])))
