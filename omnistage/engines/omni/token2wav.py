"""The ``omni-token2wav`` engine: Qwen2.5-Omni's code-to-wave model (transformers'
``Qwen2_5OmniToken2WavModel``: a DiT draws the mel spectrogram from the codes, BigVGAN
turns it into a waveform). In: the talker's ``codes`` TENSOR chunks; out: the waveform as
AUDIO chunks (int16 PCM at 24 kHz, ``AudioMeta``).

The utterance is decoded whole once its last code is in, as transformers does, in float32
with the voice's conditioning and reference mel from the checkpoint's ``spk_dict.pt``. The
DiT's starting noise is drawn from ``noise_seed`` for every utterance, so the same codes
always give the same waveform (a retry, another replica, the monolithic model seeded the
same way).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from omnistage.config.omni_args import OMNI_SAMPLE_RATE, OmniToken2WavArgs
from omnistage.config.schema import StageConfig
from omnistage.engines.base import Engine, EngineChunk, EngineRequest
from omnistage.engines.omni.checkpoint import chunk_tensor, device_of, load_omni, pick_voice
from omnistage.protocol.chunk_meta import AudioMeta, TensorMeta
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.params import StageParams

# Audio leaves in pieces of this many samples (0.2 s), the last one finishing the stage.
_PIECE = OMNI_SAMPLE_RATE // 5


class OmniToken2WavEngine(Engine):
    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        self.args = OmniToken2WavArgs.model_validate(stage.engine_args)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="omni-token2wav")
        self.token2wav: Any = None
        self.speakers: dict[str, Any] = {}

    @property
    def capacity(self) -> int:
        return 1

    async def start(self) -> None:
        self.starting = f"loading the token2wav of {self.args.model}"
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load)
        self.starting = ""

    def _load(self) -> None:
        model = load_omni(self.args)
        self.token2wav = model.token2wav.float().to(device_of(self.args))
        self.speakers = dict(model.speaker_map)

    def check(self, params: StageParams) -> None:
        pick_voice(self.speakers, params.speaking.voice)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        voice = pick_voice(self.speakers, request.params.speaking.voice)
        codes: list[Any] = []
        async for chunk in request.inputs:
            meta = chunk.meta
            if isinstance(meta, TensorMeta) and meta.name == "codes" and chunk.data:
                codes.append(chunk_tensor(meta, chunk.data))
        loop = asyncio.get_running_loop()
        pcm = await loop.run_in_executor(self._executor, self._decode, codes, voice)
        self.progress += 1
        meta_out = AudioMeta(OMNI_SAMPLE_RATE, voice=voice)
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

    async def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def pcm16(wav: Any) -> bytes:
    """A float waveform in [-1, 1] as little-endian int16 samples."""
    import torch

    scaled = (wav.clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
    return scaled.cpu().numpy().astype("<i2").tobytes()
