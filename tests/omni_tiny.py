"""A tiny random-weight Qwen2.5-Omni checkpoint, for tests and benchmarks: the real ones
are far too large here and nothing may be downloaded.

Every part is transformers' own class (Qwen2_5OmniForConditionalGeneration: thinker with
one-layer audio and vision towers, talker, token2wav's DiT and BigVGAN), only small: hidden
width 32, two layers per LM, a one-block DiT, a two-rate BigVGAN. The tokenizer is byte-level
(every byte a token) with the chat and multimodal special tokens after the 256 bytes, built
with the ``tokenizers`` library. ``spk_dict.pt`` holds two voices, as the real one does, and
``preprocessor_config.json`` the Whisper feature extractor's and the image processor's
settings in one file, as the real one has them.
"""

from __future__ import annotations

import base64
import io
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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


# The shared tiny head's talker codes per answer (random weights never say end-of-speech
# early, so every answer has this many).
OMNI_MAX_CODES = 24


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


def write_tokenizer(directory: Path, specials: tuple[str, ...] = SPECIALS) -> None:
    """A byte-level tokenizer (every byte a token) with ``specials`` after the 256 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(directory)


# The real checkpoint's image processor settings (patches of 14 pixels, 2 x 2 merged).
IMAGE_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def _add_image_processor(path: Path) -> None:
    settings = json.loads(path.read_text())
    path.write_text(json.dumps({**settings, **IMAGE_PROCESSOR}, indent=2))


def png(width: int = 56, height: int = 56, seed: int = 0) -> bytes:
    """A PNG of random colours (56 x 56: one 2 x 2 grid of merged patches, 4 tokens)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def mp4(
    frames: int = 4,
    width: int = 56,
    height: int = 56,
    fps: int = 2,
    seed: int = 0,
    form: tuple[str, str] = ("mp4", "mpeg4"),
    sound: bool = False,
) -> bytes:
    """An MP4 (MPEG-4 part 2; or another container and codec, ``form``) of random
    colours, made with PyAV: 4 frames at 2 a second are one video of 2 temporal patches
    for the omni models. ``sound``: with an audio track as long as the video (AAC, 16 kHz
    mono, a 440 Hz tone)."""
    import av
    import numpy as np

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    with av.open(out, "w", format=form[0]) as container:
        stream = container.add_stream(form[1], rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        track = container.add_stream("aac", rate=16_000, layout="mono") if sound else None
        for _ in range(frames):
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        if track is not None:
            _tone(container, track, frames / fps)
        container.mux(stream.encode())
    return out.getvalue()


def _tone(container: Any, track: Any, seconds: float, rate: int = 16_000) -> None:
    import av
    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2")
    for i in range(0, len(pcm), 1024):
        frame = av.AudioFrame.from_ndarray(pcm[None, i : i + 1024], format="s16", layout="mono")
        frame.sample_rate = rate
        container.mux(track.encode(frame))
    container.mux(track.encode())


def video_question(clip: bytes, question: str) -> list[dict[str, Any]]:
    """One user message: a video (a ``data:`` URL in vLLM's ``video_url`` part), then the
    question."""
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": question}]
    return [{"role": "user", "content": content}]


@contextmanager
def served(body: bytes, name: str) -> Iterator[str]:
    """An http URL of ``body`` (any path answers it), served on 127.0.0.1: the host the
    test heads may fetch images and videos from."""

    class File(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), File)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/{name}"
    finally:
        server.shutdown()
        server.server_close()


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
    # And the talker's attention is sharpened: near uniform at random init, its codes would
    # not depend on the positions of the prompt (which an image's patch grid sets).
    with torch.no_grad():
        model.token2wav.code2wav_bigvgan_model.conv_post.weight.mul_(1000.0)
        model.talker.codec_head.weight[CODEC_EOS].zero_()
        for layer in model.talker.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    write_tokenizer(directory)
    WhisperFeatureExtractor(feature_size=128).save_pretrained(directory)
    _add_image_processor(directory / "preprocessor_config.json")
    torch.save(_speakers(seed), directory / "spk_dict.pt")
    return directory


def one_thread_head(
    tmp: Path, directory: Path, overrides: dict[str, Any], name: str, *flags: str
) -> Any:
    """A head serving the checkpoint at ``directory`` (its own pipeline) with
    ``--stage-overrides``, its replicas on one thread each: random tiny weights have flat
    logits, so another split of a matmul could flip a token. A replica of every stage is
    up when it returns (of a stage with several, the others may still be loading)."""
    import pytest

    from tests.integration.harness import HeadProc, wait_for

    mp = pytest.MonkeyPatch()
    mp.setenv("OMP_NUM_THREADS", "1")  # the replicas inherit it
    head = HeadProc(
        tmp, str(directory), "--stage-overrides", json.dumps(overrides), *flags, name=name
    )
    mp.undo()
    try:
        head.wait_healthy(timeout=240)
        # Healthy as soon as every stage has a replica, loading or not: a first request
        # would wait for the loading ones within its own timeout.
        for stage in head.stages()["stages"]:
            sid = stage["stage_id"]
            wait_for(lambda s=sid: head.up_replicas(s), 240, what=f"stage {sid} UP")
    except BaseException:
        head.stop()
        raise
    return head


def spoken_chat(
    head: Any, messages: list[dict[str, Any]], voice: str, max_tokens: int
) -> dict[str, Any]:
    """A greedy chat body asking for text and audio (pcm16) in ``voice``."""
    return {
        "model": head.client.get("/v1/models").json()["data"][0]["id"],
        "messages": messages,
        "modalities": ["text", "audio"],
        "audio": {"voice": voice, "format": "pcm16"},
        "temperature": 0,
        "max_tokens": max_tokens,
    }


def spoken_answer(
    head: Any, messages: list[dict[str, Any]], voice: str, max_tokens: int, **more: Any
) -> tuple[str, bytes, int]:
    """A greedy spoken chat's transcript, its audio (pcm16) and its prompt's token count;
    ``more``: other fields of the body."""
    body = {**spoken_chat(head, messages, voice, max_tokens), **more}
    response = head.client.post("/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    audio = answer["choices"][0]["message"]["audio"]
    return audio["transcript"], base64.b64decode(audio["data"]), answer["usage"]["prompt_tokens"]


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


def tone_wav(seconds: float = 0.5, rate: int = 16_000) -> bytes:
    """A WAV file of a 440 Hz tone."""
    import wave

    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return out.getvalue()
