"""A tiny random-weight Qwen3-Omni (MoE) checkpoint, for tests: the real one is far too
large here and nothing may be downloaded.

Every part is transformers' own class (Qwen3OmniMoeForConditionalGeneration: a MoE thinker
with one-layer audio and vision towers, a MoE talker with its code predictor, the causal
code2wav), only small. The thinker (width 32) and the talker (width 24) differ in width, so
the talker's projections of the thinker's states are exercised. The tokenizer is byte-level
(every byte a token) with the chat, multimodal and role tokens after the 256 bytes: the
talker finds the user's turns and the assistant's by their role token, so ``user``,
``assistant`` and ``system`` are one token each, as in the real tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.omni_tiny import write_tokenizer

HIDDEN = 32  # the thinker
TALKER_HIDDEN = 24
# After the 256 byte tokens, in this order (their ids are 256, 257, ...).
SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_pad|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "system",
    "user",
    "assistant",
)
VOCAB = 256 + len(SPECIALS)
CODEBOOK = 64  # codes 0..63 in every group
CODE_GROUPS = 4  # the talker's code, then the code predictor's three residual codes
# The talker's own marks sit in the last 1024 ids of its vocabulary (transformers keeps the
# talker from saying any of them but end-of-speech).
TALKER_VOCAB = CODEBOOK + 1024
CODEC_PAD, CODEC_BOS, CODEC_EOS = CODEBOOK, CODEBOOK + 1, CODEBOOK + 2
CODEC_NOTHINK, CODEC_THINK_BOS, CODEC_THINK_EOS = CODEBOOK + 3, CODEBOOK + 4, CODEBOOK + 5
VOICES = {"ethan": CODEBOOK + 6, "chelsie": CODEBOOK + 7}
SAMPLES_PER_CODE = 8  # code2wav's upsampling: (2,) then (2, 2)


def special_id(token: str) -> int:
    return 256 + SPECIALS.index(token)


def _moe(hidden: int) -> dict[str, object]:
    return {
        "hidden_size": hidden,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 1024,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 1, 1],
            "interleaved": True,
        },
    }


def _config():  # type: ignore[no-untyped-def]
    from transformers import Qwen3OmniMoeConfig

    media = {
        "audio_token_id": special_id("<|audio_pad|>"),
        "image_token_id": special_id("<|image_pad|>"),
        "video_token_id": special_id("<|video_pad|>"),
    }
    thinker = {
        "audio_config": {
            "d_model": 16,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 32,
            "num_mel_bins": 128,
            "output_dim": HIDDEN,
            "downsample_hidden_size": 8,
            "n_window": 50,
            "n_window_infer": 100,
        },
        "vision_config": {
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": HIDDEN,
            "deepstack_visual_indexes": [0],
            "num_position_embeddings": 64,
        },
        "text_config": {
            **_moe(HIDDEN),
            "vocab_size": VOCAB,
            "eos_token_id": special_id("<|im_end|>"),
        },
        "audio_start_token_id": special_id("<|audio_start|>"),
        # Not fields of the thinker config, but read by its rope index.
        "audio_end_token_id": special_id("<|audio_end|>"),
        "vision_start_token_id": special_id("<|vision_start|>"),
        "vision_end_token_id": special_id("<|vision_end|>"),
        "user_token_id": special_id("user"),
        **media,
    }
    talker = {
        "text_config": {
            **_moe(TALKER_HIDDEN),
            "vocab_size": TALKER_VOCAB,
            # Not a field of the config class, but read by the talker's MoE block (the
            # real checkpoint's config.json has it too).
            "shared_expert_intermediate_size": 16,
        },
        "code_predictor_config": {
            "vocab_size": CODEBOOK,
            "hidden_size": TALKER_HIDDEN,
            "intermediate_size": 48,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "max_position_embeddings": 64,
            "num_code_groups": CODE_GROUPS,
        },
        "num_code_groups": CODE_GROUPS,
        "thinker_hidden_size": HIDDEN,
        "accept_hidden_layer": 1,
        "codec_eos_token_id": CODEC_EOS,
        "codec_nothink_id": CODEC_NOTHINK,
        "codec_think_bos_id": CODEC_THINK_BOS,
        "codec_think_eos_id": CODEC_THINK_EOS,
        "codec_pad_id": CODEC_PAD,
        "codec_bos_id": CODEC_BOS,
        "vision_start_token_id": special_id("<|vision_start|>"),
        "audio_start_token_id": special_id("<|audio_start|>"),
        "speaker_id": dict(VOICES),
        # Not a field of the config class either, but read by the talker (as the vision
        # tower's, for the rope index of image and video positions).
        "spatial_merge_size": 2,
        **media,
    }
    code2wav = {
        "codebook_size": CODEBOOK,
        "hidden_size": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "sliding_window": 8,
        "max_position_embeddings": 1024,
        "num_quantizers": CODE_GROUPS,
        "upsample_rates": [2, 2],
        "upsampling_ratios": [2],
        "decoder_dim": 16,
    }
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        enable_audio_output=True,
        im_start_token_id=special_id("<|im_start|>"),
        im_end_token_id=special_id("<|im_end|>"),
        tts_pad_token_id=special_id("<tts_pad>"),
        tts_bos_token_id=special_id("<tts_text_bos>"),
        tts_eos_token_id=special_id("<tts_text_eod>"),
        system_token_id=special_id("system"),
        user_token_id=special_id("user"),
        assistant_token_id=special_id("assistant"),
    )


def build_tiny_omni3(directory: Path, seed: int = 0) -> Path:
    """Write the checkpoint into ``directory`` (save_pretrained layout) and return it."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration, WhisperFeatureExtractor

    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(_config()).eval()
    # Random init leaves code2wav's output near silence (~1e-5): louder, the waveform
    # survives int16 rounding, so comparing it sample by sample checks something.
    # The talker's projection of the thinker's embeddings is 100 times louder: at random
    # init it gives ~1e-3 beside codec embeddings of ~0.2, and the text it feeds the
    # talker would change no code (so a test could not tell it was fed wrong).
    # And the talker's end-of-speech logit is held at 0, below the best of the other codes
    # (random, centred on 0), so greedy talking runs to max_new_tokens instead of ending
    # after a code or two.
    with torch.no_grad():
        model.code2wav.decoder[-1].conv.weight.mul_(3000.0)
        model.talker.text_projection.linear_fc2.weight.mul_(100.0)
        model.talker.codec_head.weight[CODEC_EOS].zero_()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    write_tokenizer(directory, SPECIALS)
    WhisperFeatureExtractor(feature_size=128).save_pretrained(directory)
    _add_image_processor(directory / "preprocessor_config.json")
    return directory


# The real checkpoint's image processor settings (patches of 16 pixels, 2 x 2 merged).
IMAGE_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def _add_image_processor(path: Path) -> None:
    settings = json.loads(path.read_text())
    path.write_text(json.dumps({**settings, **IMAGE_PROCESSOR}, indent=2))
