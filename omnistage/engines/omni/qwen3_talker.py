"""The ``omni3-talker`` engine: Qwen3-Omni's talker with its code predictor (transformers'
``Qwen3OmniMoeTalkerForConditionalGeneration``). In: the thinker's tensors (see
engines/omni/qwen3_thinker.py); out: the codec codes, one TENSOR chunk ``codes`` (int64,
shape (num_code_groups,): the talker's code, then the code predictor's residual codes) per
step as it is made, the end-of-speech step left out.

The talker's input is built by transformers' own ``Qwen3OmniMoeForConditionalGeneration
.generate``, run here with the thinker replaced by ``_Replay``, which hands back the
thinker's answer from the tensors the thinker stage sent, and with code2wav left out (its
own stage). So every detail of the talker's prompt (the user's turns projected, the voice,
the text fed step by step, the sampling) stays the reference's.

The talker starts once the thinker has finished: transformers projects the answer's
embeddings into the talker's width in one batched matmul, and projecting them row by row as
they come rounds differently, which can change a code. A code's residual codes are drawn at
the start of the next step (the code predictor runs in the talker's input preparation), so
a forward pre-hook reads each whole frame there.

An answer about a video whose own audio the thinker heard (``use_audio_in_video``) is a
400 here: transformers' talker fails on that prompt (its rope reads an audio config the
talker's config lacks), so there is no reference to be exact to; the thinker answers it
in text.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from omnistage.config.omni_args import Omni3TalkerArgs
from omnistage.engines.base import EngineChunk, EngineRequest
from omnistage.engines.omni.checkpoint import (
    MEDIA_SIZES,
    QWEN3_VOICE,
    ThreadRun,
    chunk_tensor,
    device_of,
    load_omni,
    pick_voice,
    qwen3_speakers,
    stop_criteria,
    tensor_chunk,
)
from omnistage.engines.omni.talker import OmniTalkerEngine
from omnistage.protocol.chunk_meta import TensorMeta
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.errors import BadRequestError


class Omni3TalkerEngine(OmniTalkerEngine):
    args_type = Omni3TalkerArgs
    default_voice = QWEN3_VOICE

    def _load(self) -> None:
        model = load_omni(self.args)
        device = device_of(self.args)
        # The talker's prompt reads the thinker's embedding table (the text start, end
        # and pad tokens); the rest of the thinker runs in its own stage.
        self.embed = model.thinker.get_input_embeddings().to(device)
        self.eos = model.thinker.generation_config.eos_token_id
        del model.thinker, model.code2wav
        self.model = model.to(device)
        self.talker = model.talker
        self.speakers = qwen3_speakers(model)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        voice = pick_voice(self.speakers, request.params.speaking.voice, self.default_voice)
        named: dict[str, Any] = {}
        replies: list[Any] = []
        async for chunk in request.inputs:
            self.progress += 1  # input taken in: waiting on the thinker is not a stall
            meta = chunk.meta
            if isinstance(meta, TensorMeta) and chunk.data:
                tensor = chunk_tensor(meta, chunk.data)
                if meta.name == "reply":
                    replies.append(tensor)
                else:
                    named[meta.name] = tensor
        if "use_audio_in_video" in named:
            # transformers' own talker cannot place a heard video's positions (its rope
            # reads the audio tower's config, which the talker's lacks): no reference.
            message = "Qwen3-Omni cannot speak an answer about a heard video yet; ask for text"
            raise BadRequestError(message, "mm_processor_kwargs.use_audio_in_video")
        if "prompt_embeds" in named and "first_token" in named:
            run = ThreadRun(asyncio.get_running_loop())

            def work(run: ThreadRun) -> None:
                self._talk(named, replies, voice, run)

            async for frame in run.events(self._executor, work):
                self.progress += 1
                yield tensor_chunk("codes", frame)
        yield EngineChunk(Modality.TENSOR, finished=True, finish_reason=FinishReason.STOP)

    def _talk(self, named: dict[str, Any], replies: list[Any], voice: str, run: ThreadRun) -> None:
        import torch

        device = self.talker.device
        prompt_ids = named["prompt_ids"].to(device).unsqueeze(0)

        def on_step(module: Any, args: Any, kwargs: dict[str, Any]) -> Any:
            frame = kwargs.get("residual_codes")
            if frame is not None and not run.stopped.is_set():
                run.emit(frame.reshape(-1).to("cpu"))
            return args, kwargs

        model, params = self.model, self.args
        accept = model.config.talker_config.accept_hidden_layer
        model.thinker = _Replay(named, replies, self.embed, accept, device)
        model.code2wav = _NoWave()
        extra = {"talker_eos_token_id": list(params.eos_token_ids)} if params.eos_token_ids else {}
        # The talker's positions (its rope) read the media's sizes.
        extra.update({f"talker_{n}": named[n].to(device) for n in MEDIA_SIZES if n in named})
        hook = self.talker.register_forward_pre_hook(on_step, with_kwargs=True)
        try:
            with torch.no_grad():
                model.generate(
                    input_ids=prompt_ids,
                    speaker=voice,
                    return_audio=True,
                    thinker_eos_token_id=self.eos,
                    talker_max_new_tokens=params.max_new_tokens,
                    talker_do_sample=params.do_sample,
                    talker_top_k=params.top_k,
                    talker_top_p=params.top_p,
                    talker_temperature=params.temperature,
                    talker_repetition_penalty=params.repetition_penalty,
                    talker_stopping_criteria=stop_criteria(run),
                    **extra,
                )
        finally:
            hook.remove()
            del model.thinker, model.code2wav


class _Replay:
    """The thinker as ``Qwen3OmniMoeForConditionalGeneration.generate`` reads it: its
    ``generate`` gives back the answer the thinker stage made (its sequences and, per
    step, the hidden states the talker reads: the input embeddings, and the accepted
    layer's states at the prompt's media positions)."""

    def __init__(
        self, named: dict[str, Any], replies: list[Any], embed: Any, accept: int, device: Any
    ) -> None:
        self._named, self._replies = named, replies
        self._embed, self._accept = embed, accept
        self.device = device

    def get_input_embeddings(self) -> Any:
        return self._embed

    def generate(self, input_ids: Any, **kwargs: Any) -> Any:
        import torch

        device = input_ids.device
        named = self._named
        embeds = named["prompt_embeds"].to(device).unsqueeze(0)
        # The accepted layer's states are read at media positions only; without any, the
        # thinker sent none, and the embeddings stand in (same shape, never read).
        hidden = named.get("prompt_hidden", named["prompt_embeds"]).to(device).unsqueeze(0)
        steps = [_layers(embeds, hidden, self._accept)]
        for reply in self._replies:
            state = reply.to(device).unsqueeze(0)
            steps.append(_layers(state, state, self._accept))
        # The answer's ids after the first are read only to find its end-of-text, which
        # for one answer moves nothing: the thinker's last token (an end-of-text or the
        # length limit) is the one never fed back, so the text fed to the talker ends
        # after the last reply either way. The first token stands in for them.
        first = named["first_token"].to(device).reshape(1, 1)
        answer = first.expand(1, len(self._replies) + 1)
        return SimpleNamespace(
            sequences=torch.cat([input_ids, answer], dim=1), hidden_states=tuple(steps)
        )


def _layers(embeds: Any, hidden: Any, accept: int) -> tuple[Any, ...]:
    """One step's hidden states as the thinker's ``generate`` gives them, as far as the
    talker reads them: the input embeddings first, the accepted layer's at ``accept``."""
    return (embeds,) + (hidden,) * accept if accept else (embeds,)


class _NoWave:
    """code2wav runs in its own stage: the monolithic decode is skipped here."""

    def chunked_decode(self, codes: Any, **kwargs: Any) -> Any:
        import torch

        return torch.zeros(1, 1, 0)
