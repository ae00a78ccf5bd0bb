"""The ``omni-token2wav`` engine: Qwen2.5-Omni's code-to-wave model (transformers'
``Qwen2_5OmniToken2WavModel``: a DiT draws the mel spectrogram from the codes, BigVGAN
turns it into a waveform). In: the talker's ``codes`` TENSOR chunks; out: the waveform as
AUDIO chunks (int16 PCM at 24 kHz, ``AudioMeta``).

By default the utterance is decoded whole once its last code is in, as transformers does,
in float32 with the voice's conditioning and reference mel from the checkpoint's
``spk_dict.pt``. The DiT's starting noise is drawn from ``noise_seed`` for every utterance,
so the same codes always give the same waveform (a retry, another replica, the monolithic
model seeded the same way). With ``chunk_codes``, audio leaves chunk by chunk as the codes
come, close to the whole decode but not equal to it (see ``code_chunks``). Either way the
DiT's speaker encoder runs once per voice, not in every DiT evaluation
(``remember_speakers``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from omnistage.config.omni_args import OMNI_SAMPLE_RATE, OmniToken2WavArgs
from omnistage.config.schema import StageConfig
from omnistage.engines.base import Engine, EngineChunk, EngineRequest
from omnistage.engines.omni import code_chunks
from omnistage.engines.omni.checkpoint import (
    chunk_tensor,
    device_of,
    load_omni,
    pick_voice,
    placement,
)
from omnistage.protocol.chunk_meta import AudioMeta, TensorMeta
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.params import StageParams

# Audio leaves in pieces of this many samples (0.2 s), the last one finishing the stage.
_PIECE = OMNI_SAMPLE_RATE // 5
# Speaker-encoder results kept (see remember_speakers): one or two per voice in use.
_SPEAKERS_KEPT = 16


class OmniToken2WavEngine(Engine):
    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        self.args = OmniToken2WavArgs.model_validate(stage.engine_args)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="omni-token2wav")
        self.token2wav: Any = None
        self.speakers: dict[str, Any] = {}

    async def start(self) -> None:
        self.starting = f"loading the token2wav of {self.args.model}"
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load)
        self.starting = ""

    def _load(self) -> None:
        # float32 from the file, not rounded through the thinker's dtype and back.
        model = load_omni(self.args, dtype="float32")
        self.token2wav = model.token2wav.to(device_of(self.args))
        self.kernel = placement(self.token2wav)
        remember_speakers(self.token2wav.code2wav_dit_model.input_embed.spk_encoder)
        self.speakers = dict(model.speaker_map)
        if self.args.chunk_codes:
            dit = self.token2wav.code2wav_dit_model.config
            frames = dit.max_position_embeddings
            self._noise = code_chunks.noise(self.args.noise_seed, frames, dit.mel_dim)

    def check(self, params: StageParams) -> None:
        pick_voice(self.speakers, params.speaking.voice)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        voice = pick_voice(self.speakers, request.params.speaking.voice)
        meta_out = AudioMeta(OMNI_SAMPLE_RATE, voice=voice)
        if self.args.chunk_codes:
            async for piece in self._chunked(request, voice):
                yield piece
            yield EngineChunk(
                Modality.AUDIO, meta=meta_out, finished=True, finish_reason=FinishReason.STOP
            )
            return
        codes = []
        async for code in codes_of(request):
            self.progress += 1  # input taken in: waiting on the talker is not a stall
            codes.append(code)
        loop = asyncio.get_running_loop()
        pcm = await loop.run_in_executor(self._executor, self._decode, codes, voice)
        self.progress += 1
        for start in range(0, max(len(pcm), 1), _PIECE):
            last = start + _PIECE >= len(pcm)
            yield EngineChunk(
                Modality.AUDIO,
                data=pcm[start : start + _PIECE],
                meta=meta_out,
                finished=last,
                finish_reason=FinishReason.STOP if last else None,
            )

    def _decode(self, codes: list[Any], voice: str) -> bytes:
        """The int16 PCM of the codes (empty for none)."""
        import torch

        if not codes:
            return b""
        device = self.token2wav.device
        code = torch.cat([c.reshape(-1) for c in codes]).to(device).unsqueeze(0)
        speaker = self.speakers[voice]
        with torch.no_grad():
            torch.manual_seed(self.args.noise_seed)
            wav = self.token2wav(
                code,
                conditioning=speaker["cond"].to(device).float().expand(1, -1),
                reference_mel=speaker["ref_mel"].to(device).float().expand(1, -1, -1),
                num_steps=self.args.num_steps,
                guidance_scale=self.args.guidance_scale,
                sway_coefficient=self.args.sway_coefficient,
            )
        return pcm16(wav.reshape(-1).float())

    async def _chunked(self, request: EngineRequest, voice: str) -> AsyncIterator[EngineChunk]:
        """Audio chunk by chunk, each as soon as its codes and margin have come."""
        args, loop = self.args, asyncio.get_running_loop()
        plan = code_chunks.ChunkPlan(args.chunk_codes, args.past_codes, args.future_codes)
        codes: list[int] = []
        meta = AudioMeta(OMNI_SAMPLE_RATE, voice=voice)

        async def ready(ended: bool) -> AsyncIterator[EngineChunk]:
            while (window := plan.next(len(codes), ended)) is not None:
                span = codes[window.lo : window.hi]
                pcm = await loop.run_in_executor(
                    self._executor, self._decode_window, span, window, voice
                )
                self.progress += 1
                yield EngineChunk(Modality.AUDIO, data=pcm, meta=meta)

        async for code in codes_of(request):
            self.progress += 1
            codes.extend(code.reshape(-1).tolist())
            async for piece in ready(False):
                yield piece
        async for piece in ready(True):
            yield piece

    def _decode_window(self, span: list[int], window: code_chunks.Window, voice: str) -> bytes:
        import torch

        dit = self.token2wav.code2wav_dit_model
        device, r = self.token2wav.device, dit.repeats
        speaker = self.speakers[voice]
        code = torch.tensor([span], dtype=torch.long, device=device)
        with torch.no_grad():
            mel = code_chunks.sample(
                dit,
                speaker["cond"].to(device).float().expand(1, -1),
                speaker["ref_mel"].to(device).float().expand(1, -1, -1),
                code,
                self._noise[:, window.lo * r : window.hi * r].to(device),
                self.args.num_steps,
                self.args.guidance_scale,
                self.args.sway_coefficient,
            )
            wav = code_chunks.vocode_span(
                self.token2wav.code2wav_bigvgan_model,
                mel,
                (window.start - window.lo) * r,
                (window.end - window.lo) * r,
                self.args.vocoder_context_frames,
            )
        return pcm16(wav.float())

    async def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def remember_speakers(encoder: Any) -> None:
    """Make the DiT's speaker encoder (an ECAPA-TDNN over the voice's reference mel) run
    once per input it is given, not on every call. transformers calls it in every
    evaluation of the DiT: 4 per ODE step (RK4), 36 per utterance at 10 steps, always on
    the same input, the voice's reference mel (and zeros, for the unguided half): on the
    tiny checkpoint that was half of token2wav's time. The result is the encoder's own
    output for that very input, so the waveform does not change; without grad only."""
    import torch

    forward = encoder.forward
    kept: list[tuple[Any, Any]] = []  # (input, output), the newest last

    def remembered(hidden_states: Any) -> Any:
        if torch.is_grad_enabled():
            return forward(hidden_states)
        for seen, out in kept:
            if seen.shape == hidden_states.shape and torch.equal(seen, hidden_states):
                return out
        out = forward(hidden_states)
        kept.append((hidden_states.clone(), out))
        del kept[:-_SPEAKERS_KEPT]
        return out

    encoder.forward = remembered


async def codes_of(request: EngineRequest) -> AsyncIterator[Any]:
    """The talker's codes as they come (tensors)."""
    async for chunk in request.inputs:
        meta = chunk.meta
        if isinstance(meta, TensorMeta) and meta.name == "codes" and chunk.data:
            yield chunk_tensor(meta, chunk.data)


def pcm16(wav: Any) -> bytes:
    """A float waveform in [-1, 1] as little-endian int16 samples."""
    import torch

    scaled = (wav.clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
    return scaled.cpu().numpy().astype("<i2").tobytes()
