"""The ``omni-talker`` engine's decode loop (engines/omni/talker_loop.py) against
transformers' own ``generate`` on the same talker: the same codes, greedy and sampled.

The engine is served its inputs as the thinker stage sends them (a prompt, its first
answer token, the replies of the later tokens, as tensor chunks); the reference is the
talker's ``generate`` called as ``Qwen2_5OmniForConditionalGeneration.generate`` calls it,
with the whole reply up front. Sampled runs seed torch's generator the same way before
each side, so equal codes mean the same draws from it. The exactness tests of the served
pipeline (test_omni_staged.py) cover greedy decoding end to end; this covers sampling,
which they do not, and answers shorter and longer than the code budget.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
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
from tests.omni_tiny import CODEC_EOS

pytestmark = pytest.mark.slow

PROMPT, REPLIES = 12, 6


def _thinker_tensors(width: int) -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(3)
    return {
        "prompt_ids": torch.randint(0, 250, (PROMPT,), generator=generator),
        "prompt": torch.randn(PROMPT, width, generator=generator),
        "first_token": torch.tensor([7]),
        "replies": [torch.randn(1, width, generator=generator) for _ in range(REPLIES)],
    }


async def _engine_codes(engine: Any, tensors: dict[str, Any]) -> list[int]:
    async def inputs() -> Any:
        named = [(n, tensors[n]) for n in ("prompt_ids", "prompt", "first_token")]
        for name, tensor in named + [("reply", r) for r in tensors["replies"]]:
            chunk = tensor_chunk(name, tensor)
            yield stage_input(0, modality=chunk.modality, data=chunk.data, meta=chunk.meta)

    request = EngineRequest("r", None, StageParams(speech=SpeechParams("Chelsie")), inputs())
    codes: list[int] = []
    async for out in engine.generate(request):
        if out.modality == Modality.TENSOR and out.data:
            codes += np.frombuffer(out.data, "<i8").tolist()
    return codes


def _generate_codes(engine: Any, tensors: dict[str, Any], args: dict[str, Any]) -> list[int]:
    """The talker's codes from transformers' ``generate``, fed as the monolithic model
    feeds it, cut at the first end code as the monolithic model cuts them."""
    import torch

    talker, embed = engine.talker, engine.embed
    speaker = engine.speakers["Chelsie"]

    def token(value: int) -> Any:
        return torch.full((1, 1), value, dtype=torch.long)

    replies = torch.cat(tensors["replies"], dim=0).unsqueeze(0)
    ids = tensors["prompt_ids"].unsqueeze(0)
    voice = embed(token(speaker["bos_token"]))
    with torch.no_grad():
        out = talker.generate(
            input_ids=torch.cat(
                [
                    torch.full_like(ids, talker.codec_mask_token),
                    token(talker.codec_pad_token),
                    token(talker.codec_bos_token),
                ],
                dim=1,
            ),
            input_text_ids=torch.cat(
                [ids, token(speaker["bos_token"]), tensors["first_token"].reshape(1, 1)], dim=-1
            ),
            inputs_embeds=torch.cat(
                [
                    tensors["prompt"].unsqueeze(0),
                    voice,
                    replies[:, :1],
                ],
                dim=1,
            ),
            thinker_reply_part=torch.cat(
                [
                    replies[:, 1:],
                    embed(token(talker.text_eos_token)),
                    embed(token(talker.text_pad_token)),
                ],
                dim=1,
            ),
            suppress_tokens=[talker.codec_bos_token],
            eos_token_id=[CODEC_EOS],
            pad_token_id=talker.codec_pad_token,
            **args,
        )
    codes = out[0, PROMPT + 2 :].tolist()
    return codes[: codes.index(CODEC_EOS)] if CODEC_EOS in codes else codes


@pytest.fixture(scope="module")
def talker(omni_dir: Path) -> Iterator[Any]:
    """One talker engine for the module (its worker thread outlives each test's loop)."""
    stage = StageConfig.model_validate(qwen2_5_omni(str(omni_dir))["stages"][1])
    engine = build_engine(stage)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.shutdown())


@pytest.mark.parametrize("max_codes", [1, 2, 40])
async def test_greedy_codes_are_generates(talker: Any, max_codes: int) -> None:
    import torch

    tensors = _thinker_tensors(talker.embed.embedding_dim)
    settings = {"do_sample": False, "max_new_tokens": max_codes}
    talker.args = talker.args.model_copy(update=settings)
    args = {**settings, "repetition_penalty": talker.args.repetition_penalty}
    want = _generate_codes(talker, tensors, args)
    torch.manual_seed(0)
    assert await _engine_codes(talker, tensors) == want
    assert len(want) == max_codes  # the tiny talker never ends early when greedy


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
async def test_sampled_codes_are_generates_for_the_same_seed(talker: Any, seed: int) -> None:
    import torch

    tensors = _thinker_tensors(talker.embed.embedding_dim)
    talker.args = talker.args.model_copy(update={"do_sample": True, "max_new_tokens": 40})
    a = talker.args
    args = {
        "do_sample": True,
        "max_new_tokens": 40,
        "top_k": a.top_k,
        "top_p": a.top_p,
        "temperature": a.temperature,
        "repetition_penalty": a.repetition_penalty,
    }
    torch.manual_seed(seed)
    want = _generate_codes(talker, tensors, args)
    torch.manual_seed(seed)
    assert await _engine_codes(talker, tensors) == want
