"""A tiny random-weight Qwen2.5-Omni checkpoint, for tests and benchmarks: the real ones
are far too large here and nothing may be downloaded.

Every part is transformers' own class (Qwen2_5OmniForConditionalGeneration: thinker with
one-layer audio and vision towers, talker, token2wav's DiT and BigVGAN), only small: hidden
width 32, two layers per LM, a one-block DiT, a two-rate BigVGAN. The tokenizer is byte-level
(every byte a token) with the chat and multimodal special tokens after the 256 bytes, built
with the ``tokenizers`` library. ``spk_dict.pt`` holds two voices, as the real one does.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HIDDEN = 32
VOICES = ("Chelsie", "Ethan")
# After the 256 byte tokens, in this order (their ids are 256, 257, ...).
SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|tts_bos|>",
    "<|tts_eos|>",
    "<|tts_pad|>",
    "<|voice_chelsie|>",
    "<|voice_ethan|>",
    "<|extra_0|>",
)
VOCAB = 256 + len(SPECIALS)
CODEC_VOCAB = 64  # codec codes 0..59 speak; the last four are the talker's own marks
CODEC_PAD, CODEC_BOS, CODEC_EOS, CODEC_MASK = 60, 61, 62, 63
MEL_DIM = 16
SAMPLES_PER_FRAME = 16  # BigVGAN's upsample rates (4, 4)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def special_id(token: str) -> int:
    return 256 + SPECIALS.index(token)


def _config(width: int = HIDDEN, layers: int = 2):  # type: ignore[no-untyped-def]
    from transformers import (
        Qwen2_5OmniConfig,
        Qwen2_5OmniTalkerConfig,
        Qwen2_5OmniThinkerConfig,
        Qwen2_5OmniToken2WavConfig,
    )

    ids = {
        "audio_token_index": special_id("<|AUDIO|>"),
        "image_token_index": special_id("<|IMAGE|>"),
        "video_token_index": special_id("<|VIDEO|>"),
        "audio_start_token_id": special_id("<|audio_bos|>"),
        "audio_end_token_id": special_id("<|audio_eos|>"),
        "vision_start_token_id": special_id("<|vision_bos|>"),
        "vision_end_token_id": special_id("<|vision_eos|>"),
    }
    thinker = Qwen2_5OmniThinkerConfig(
        audio_config={
            "d_model": 16,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 32,
            "num_mel_bins": 128,
            "output_dim": width,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": width,
            "fullatt_block_indexes": [0],
        },
        text_config={
            "vocab_size": VOCAB,
            "hidden_size": width,
            "intermediate_size": 2 * width,
            "num_hidden_layers": layers,
            "num_attention_heads": width // 8,
            "num_key_value_heads": width // 16,
            "max_position_embeddings": 1024,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 1, 1],
            },
            "eos_token_id": special_id("<|im_end|>"),
        },
        user_token_id=special_id("<|im_start|>"),
        **{k: v for k, v in ids.items() if k.endswith("index") or "audio_" in k},
    )
    # Not constructor arguments of the thinker config, but read by its rope index.
    thinker.vision_start_token_id = ids["vision_start_token_id"]
    thinker.vision_end_token_id = ids["vision_end_token_id"]
    talker = Qwen2_5OmniTalkerConfig(
        vocab_size=CODEC_VOCAB,
        tts_text_start_token_id=special_id("<|tts_bos|>"),
        tts_text_end_token_id=special_id("<|tts_eos|>"),
        tts_text_pad_token_id=special_id("<|tts_pad|>"),
        tts_codec_start_token_id=CODEC_BOS,
        tts_codec_end_token_id=CODEC_EOS,
        tts_codec_pad_token_id=CODEC_PAD,
        tts_codec_mask_token_id=CODEC_MASK,
        embedding_size=width,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=width // 8,
        num_key_value_heads=width // 16,
        head_dim=8,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
        **ids,
    )
    token2wav = Qwen2_5OmniToken2WavConfig(
        dit_config={
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 16,
            "ff_mult": 2,
            "emb_dim": 16,
            "max_position_embeddings": 1024,
            "block_size": 8,
            "look_ahead_layers": [0],
            "look_backward_layers": [0],
            "repeats": 2,
            "num_embeds": CODEC_VOCAB,
            "mel_dim": MEL_DIM,
            "dropout": 0.0,
            "enc_emb_dim": 16,
            "enc_dim": 16,
            "enc_channels": [16, 16, 16, 16, 48],
            "enc_kernel_sizes": [5, 3, 3, 3, 1],
            "enc_dilations": [1, 2, 3, 4, 1],
            "enc_attention_channels": 8,
            "enc_res2net_scale": 2,
            "enc_se_channels": 8,
        },
        bigvgan_config={
            "mel_dim": MEL_DIM,
            "upsample_initial_channel": 16,
            "resblock_kernel_sizes": [3],
            "resblock_dilation_sizes": [[1, 3, 5]],
            "upsample_rates": [4, 4],
            "upsample_kernel_sizes": [8, 8],
        },
    )
    return Qwen2_5OmniConfig(
        thinker_config=thinker,
        talker_config=talker,
        token2wav_config=token2wav,
        enable_audio_output=True,
    )


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(directory)


def _speakers(seed: int):  # type: ignore[no-untyped-def]
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    return {
        name: {
            "bos_token": special_id(f"<|voice_{name.lower()}|>"),
            "cond": torch.randn(1, 16, generator=gen),
            "ref_mel": torch.randn(1, 12, MEL_DIM, generator=gen),
        }
        for name in VOICES
    }


def build_tiny_omni(
    directory: Path, seed: int = 0, *, width: int = HIDDEN, layers: int = 2
) -> Path:
    """Write the checkpoint into ``directory`` (save_pretrained layout) and return it.
    ``width`` (a multiple of 16: heads of 8) and ``layers`` size the thinker's and the
    talker's LMs (benchmarks make them bigger, so that the models' work dominates)."""
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration, WhisperFeatureExtractor

    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(_config(width, layers)).eval()
    # Random init leaves the vocoder's output near silence (~1e-4): louder, the waveform
    # survives int16 rounding, so comparing it sample by sample checks something.
    # And the talker's end-of-speech logit is held at 0, below the best of the other 63
    # (random, centred on 0), so greedy talking runs to max_new_tokens instead of ending
    # after a code or two.
    with torch.no_grad():
        model.token2wav.code2wav_bigvgan_model.conv_post.weight.mul_(1000.0)
        model.talker.codec_head.weight[CODEC_EOS].zero_()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    _write_tokenizer(directory)
    WhisperFeatureExtractor(feature_size=128).save_pretrained(directory)
    torch.save(_speakers(seed), directory / "spk_dict.pt")
    return directory


def spoken_deltas(head: Any, body: dict[str, Any], timeout: float) -> Iterator[tuple[str, bytes]]:
    """A streamed chat's audio deltas as they come: (transcript piece, audio bytes)."""
    with head.client.stream("POST", "/v1/chat/completions", json=body, timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                spoken = choice["delta"].get("audio") or {}
                data = spoken.get("data")
                yield spoken.get("transcript", ""), base64.b64decode(data) if data else b""
