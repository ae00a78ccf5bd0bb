"""Token2wav in chunks (``chunk_codes``) on the tiny Qwen2.5-Omni checkpoint: audio leaves
before the last code has come, and stays within a stated tolerance of the whole decode.

Tolerance: with margins (4-code chunks, 8 codes before, 4 after, 8 mel frames of vocoder
context) every sample is within 1 int16 step of the whole decode's. The only difference
is what the margins leave out (the noise of every frame is the whole decode's), and the
tiny DiT (one layer, 8-frame blocks) looks no further than a block each side per step;
without margins the same chunks miss by thousands of steps, so the margins are what the
check checks. One window covering the utterance is the whole decode exactly.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omnistage.config.models import qwen2_5_omni
from omnistage.config.schema import StageConfig
from omnistage.engines import build_engine
from omnistage.engines.base import EngineRequest, stage_input
from omnistage.engines.omni.checkpoint import tensor_chunk
from omnistage.protocol.enums import Modality
from omnistage.protocol.params import SpeechParams, StageParams
from tests.omni_tiny import build_tiny_omni

CODES = 40
MARGINS = {"chunk_codes": 4, "past_codes": 8, "future_codes": 4, "vocoder_context_frames": 8}


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_omni(tmp_path_factory.mktemp("omni") / "qwen2.5-omni-tiny")


async def _speak(
    directory: Path, codes: list[int], hold: bool = False, **args: Any
) -> tuple[np.ndarray, int]:
    """The waveform for ``codes``, and how many codes had been sent when the first audio
    came out. ``hold``: the last code waits for the first audio (a talker still talking)."""
    raw = qwen2_5_omni(str(directory))["stages"][2]
    stage = StageConfig.model_validate({**raw, "engine_args": {**raw["engine_args"], **args}})
    engine = build_engine(stage)
    await engine.start()
    sent, first_at, gate = 0, None, asyncio.Event()

    async def inputs() -> Any:
        nonlocal sent
        for code in codes:
            chunk = tensor_chunk("codes", _long(code))
            yield stage_input(1, modality=chunk.modality, data=chunk.data, meta=chunk.meta)
            sent += 1
            await asyncio.sleep(0)  # let the engine look at what it has
            if hold and sent == len(codes) - 1:
                await asyncio.wait_for(gate.wait(), 60)

    request = EngineRequest("r", None, StageParams(speech=SpeechParams("Chelsie")), inputs())
    pieces = []
    async for out in engine.generate(request):
        if out.data and out.modality == Modality.AUDIO:
            first_at = sent if first_at is None else first_at
            gate.set()
            pieces.append(out.data)
    await engine.shutdown()
    return np.frombuffer(b"".join(pieces), "<i2").astype(np.int64), first_at or 0


def _long(code: int) -> Any:
    import torch

    return torch.tensor([code], dtype=torch.long)


def _codes() -> list[int]:
    return [int(c) for c in np.random.default_rng(5).integers(0, 60, CODES)]


async def test_one_window_over_the_utterance_is_the_whole_decode(omni_dir: Path) -> None:
    whole, _ = await _speak(omni_dir, _codes())
    single, _ = await _speak(omni_dir, _codes(), chunk_codes=1000)
    assert len(whole) == CODES * 2 * 16
    assert np.array_equal(single, whole)


async def test_chunks_leave_early_and_stay_within_one_step_of_the_whole(omni_dir: Path) -> None:
    whole, _ = await _speak(omni_dir, _codes())
    chunked, first_at = await _speak(omni_dir, _codes(), hold=True, **MARGINS)
    assert first_at < CODES  # audio before the last code
    assert len(chunked) == len(whole)
    assert np.abs(chunked - whole).max() <= 1


async def test_without_margins_chunks_miss_by_far(omni_dir: Path) -> None:
    whole, _ = await _speak(omni_dir, _codes())
    bare = {**MARGINS, "past_codes": 0, "future_codes": 0, "vocoder_context_frames": 0}
    chunked, _ = await _speak(omni_dir, _codes(), **bare)
    assert np.abs(chunked - whole).max() > 100
