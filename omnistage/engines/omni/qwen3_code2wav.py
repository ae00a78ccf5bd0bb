"""The ``omni3-code2wav`` engine: Qwen3-Omni's code-to-wave model (transformers'
``Qwen3OmniMoeCode2Wav``, causal). In: the talker's ``codes`` TENSOR chunks (one frame of
``num_code_groups`` codes each); out: the waveform as AUDIO chunks (int16 PCM at 24 kHz,
``AudioMeta``), chunk by chunk as the codes come.

Chunks are decoded as ``Qwen3OmniMoeCode2Wav.chunked_decode`` decodes them for the
monolithic model: ``chunk_codes`` codes at a time, each with ``left_context_codes`` codes
before it whose samples are dropped. A chunk leaves as soon as its last code is in (the
model is causal: no later code changes it), and the rest when the talker ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from omnistage.config.omni_args import OMNI_SAMPLE_RATE, Omni3Code2WavArgs
from omnistage.config.schema import StageConfig
from omnistage.engines.base import Engine, EngineChunk, EngineRequest
from omnistage.engines.omni.checkpoint import (
    QWEN3_VOICE,
    device_of,
    load_omni,
    pick_voice,
    qwen3_speakers,
)
from omnistage.engines.omni.code_chunks import ChunkPlan, Window
from omnistage.engines.omni.token2wav import codes_of, pcm16
from omnistage.protocol.chunk_meta import AudioMeta
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.params import StageParams


class Omni3Code2WavEngine(Engine):
    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        self.args = Omni3Code2WavArgs.model_validate(stage.engine_args)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="omni3-code2wav")
        self.code2wav: Any = None
        self.speakers: dict[str, int] = {}

    async def start(self) -> None:
        self.starting = f"loading the code2wav of {self.args.model}"
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load)
        self.starting = ""

    def _load(self) -> None:
        model = load_omni(self.args)
        self.code2wav = model.code2wav.to(device_of(self.args))
        self.speakers = qwen3_speakers(model)

    def check(self, params: StageParams) -> None:
        pick_voice(self.speakers, params.speaking.voice, QWEN3_VOICE)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        loop, args = asyncio.get_running_loop(), self.args
        plan = ChunkPlan(args.chunk_codes, args.left_context_codes, 0)
        voice = pick_voice(self.speakers, request.params.speaking.voice, QWEN3_VOICE)
        meta = AudioMeta(OMNI_SAMPLE_RATE, voice=voice)
        frames: list[Any] = []

        async def ready(ended: bool) -> AsyncIterator[EngineChunk]:
            while (window := plan.next(len(frames), ended)) is not None:
                span = frames[window.lo : window.hi]
                pcm = await loop.run_in_executor(self._executor, self._decode, span, window)
                self.progress += 1
                yield EngineChunk(Modality.AUDIO, data=pcm, meta=meta)

        async for frame in codes_of(request):
            self.progress += 1  # input taken in: waiting on the talker is not a stall
            frames.append(frame.reshape(-1))
            async for piece in ready(False):
                yield piece
        async for piece in ready(True):
            yield piece
        yield EngineChunk(Modality.AUDIO, meta=meta, finished=True, finish_reason=FinishReason.STOP)

    def _decode(self, span: list[Any], window: Window) -> bytes:
        """The int16 PCM of codes ``[window.start, window.end)`` from ``span`` (the codes
        ``[window.lo, window.end)``, one frame each)."""
        import torch

        model = self.code2wav
        codes = torch.stack(span, dim=-1).unsqueeze(0).to(model.device)  # (1, groups, codes)
        with torch.no_grad():
            wav = model(codes)
        drop = (window.start - window.lo) * int(model.total_upsample)
        return pcm16(wav[..., drop:].reshape(-1).float())

    async def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
