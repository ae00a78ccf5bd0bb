"""The ``omni-talker`` engine: Qwen2.5-Omni's talker (transformers'
``Qwen2_5OmniTalkerForConditionalGeneration``). In: the thinker's tensors (see
engines/omni/thinker.py) as they stream; out: the codec codes as they are made, in TENSOR
chunks ``codes`` (int64, shape (n,)) of ``codes_per_chunk`` codes (the last one may hold
fewer), the end-of-speech code left out.

Codes leave in fixed groups, not one by one: each chunk costs both replicas' event loops
a message, and the talker's loop takes the GIL from the decode step to send it. On the
tiny benchmark checkpoint (96 codes an answer, 2-vCPU VM) one code a chunk cost the
talker's loop 33 ms of CPU an answer and token2wav's 23 ms; four a chunk, 13 and 8. The
groups are fixed, not whatever queued up, so a rerun of the same request sends the same
chunks.

It starts as soon as the thinker's prompt and first answer token are in, and each decode
step waits for the thinker's tensor it reads, so talking overlaps thinking. The inputs are
built as ``Qwen2_5OmniForConditionalGeneration.generate`` builds them. transformers' own
``generate`` runs the talker's prompt step and makes the first code; the later steps call
the talker's forward directly, as ``generate`` would, each with the thinker's reply for
that step instead of the whole reply up front (``talker_loop``: the same codes for ~9%
less CPU an answer than the same decode through ``generate``'s loop).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from omnistage.config.omni_args import OmniTalkerArgs
from omnistage.config.schema import StageConfig
from omnistage.engines.base import Engine, EngineChunk, EngineRequest, StageInput
from omnistage.engines.omni.checkpoint import (
    DEFAULT_VOICE,
    MEDIA_SIZES,
    Cancelled,
    ThreadRun,
    chunk_tensor,
    device_of,
    load_omni,
    pick_voice,
    placement,
    stop_criteria,
    tensor_chunk,
)
from omnistage.engines.omni.talker_loop import PrefillCapture, Sampling, decode_rest, first_code
from omnistage.protocol.chunk_meta import TensorMeta
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.params import StageParams

# How often a wait for the thinker looks whether the request was aborted (seconds).
_POLL_S = 0.2
# The thinker's tensors the talker's first step reads (with the first ``reply``).
_STARTS = frozenset({"prompt_ids", "prompt", "first_token"})


class ReplyFeed:
    """The thinker's tensors for one request, filled by the engine's event loop and read
    by the talker's worker thread, which blocks until what it reads has come."""

    def __init__(self, stopped: threading.Event) -> None:
        self._stopped = stopped  # the request was aborted: stop waiting
        self._cond = threading.Condition()
        self.named: dict[str, Any] = {}
        self.replies: list[Any] = []
        self.ended = False

    def put(self, name: str, tensor: Any) -> None:
        with self._cond:
            if name == "reply":
                self.replies.append(tensor)
            else:
                self.named[name] = tensor
            self._cond.notify_all()

    def end(self) -> None:
        with self._cond:
            self.ended = True
            self._cond.notify_all()

    def _wait(self, ready: Any) -> None:
        with self._cond:
            while not ready() and not self.ended and not self._stopped.is_set():
                self._cond.wait(_POLL_S)
            if self._stopped.is_set():
                raise Cancelled

    def start(self) -> bool:
        """Wait for the prompt and the first reply; False if the thinker ended first (an
        answer of one token: nothing to speak)."""
        self._wait(lambda: set(self.named) >= _STARTS and bool(self.replies))
        return bool(self.replies) and "prompt" in self.named

    def reply(self, step: int, eos: Any, pad: Any) -> Any:
        """What decode step ``step`` (1, 2, ...) adds to its codec embedding: the thinker's
        reply for answer token ``step``; once the thinker has ended, the text-end
        embedding right after its last reply, then the pad embedding."""
        self._wait(lambda: len(self.replies) > step)
        if step < len(self.replies):
            return self.replies[step]
        return eos if step == len(self.replies) else pad


class OmniTalkerEngine(Engine):
    args_type: type[OmniTalkerArgs] = OmniTalkerArgs
    default_voice = DEFAULT_VOICE  # transformers' default speaker

    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        self.args = self.args_type.model_validate(stage.engine_args)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="omni-talker")
        self.talker: Any = None
        self.embed: Any = None
        self.speakers: dict[str, Any] = {}

    async def start(self) -> None:
        self.starting = f"loading the talker of {self.args.model}"
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load)
        self.starting = ""

    def _load(self) -> None:
        model = load_omni(self.args)
        device = device_of(self.args)
        # The talker reads the thinker's embedding table (the voice's and the text end
        # and pad tokens); the rest of the thinker runs in its own stage.
        self.embed = model.thinker.get_input_embeddings().to(device)
        self.talker = model.talker.to(device)
        self.kernel = placement(self.talker)
        self.speakers = dict(model.speaker_map)
        eos = self.args.eos_token_ids or (self.talker.codec_eos_token,)
        self._eos = frozenset(eos)

    def check(self, params: StageParams) -> None:
        pick_voice(self.speakers, params.speaking.voice, self.default_voice)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        voice = pick_voice(self.speakers, request.params.speaking.voice, self.default_voice)
        run = ThreadRun(asyncio.get_running_loop())
        feed = ReplyFeed(run.stopped)
        reader = asyncio.create_task(self._read(request.inputs, feed))

        def work(run: ThreadRun) -> None:
            self._generate(feed, self.speakers[voice], run)

        try:
            async for codes in run.events(self._executor, work):
                self.progress += 1
                yield tensor_chunk("codes", _long(codes))
        finally:
            reader.cancel()
        # No usage: the request's tokens are the thinker's (codes are not tokens a
        # client is billed for).
        yield EngineChunk(Modality.TENSOR, finished=True, finish_reason=FinishReason.STOP)

    def _inputs(self, feed: ReplyFeed, speaker: dict[str, Any]) -> dict[str, Any]:
        """The talker's prompt, as ``Qwen2_5OmniForConditionalGeneration.generate`` builds
        it: the thinker's prompt states, the voice's text-start embedding and the first
        answer token's state; codec mask codes under the prompt, then pad and start."""
        import torch

        talker, device = self.talker, self.talker.device
        ids = feed.named["prompt_ids"].to(device).unsqueeze(0)
        first = feed.named["first_token"].to(device).reshape(1, 1)

        def token(value: int) -> Any:
            return torch.full((1, 1), value, dtype=torch.long, device=device)

        def embedded(value: int) -> Any:
            return self.embed(token(value)).to(device)

        bos = int(speaker["bos_token"])
        extra = {n: feed.named[n].to(device) for n in MEDIA_SIZES if n in feed.named}
        codec = (talker.codec_mask_token, talker.codec_pad_token, talker.codec_bos_token)
        # The thinker's states in the talker's dtype (the two stages may load differently).
        state = feed.named["prompt"].to(device, talker.dtype).unsqueeze(0)
        return {
            **extra,
            "use_audio_in_video": "use_audio_in_video" in feed.named,
            "input_ids": torch.cat(
                [torch.full_like(ids, codec[0]), token(codec[1]), token(codec[2])], dim=1
            ),
            "input_text_ids": torch.cat([ids, token(bos), first], dim=-1),
            "inputs_embeds": torch.cat(
                [state, embedded(bos), feed.replies[0].to(device, talker.dtype).unsqueeze(0)],
                dim=1,
            ),
            "eos": embedded(talker.text_eos_token),
            "pad": embedded(talker.text_pad_token),
        }

    def _generate(self, feed: ReplyFeed, speaker: dict[str, Any], run: ThreadRun) -> None:
        import torch

        if not feed.start():
            return
        talker, device = self.talker, self.talker.device
        inputs = self._inputs(feed, speaker)
        eos, pad = inputs.pop("eos"), inputs.pop("pad")

        def reply(step: int) -> Any:
            part = feed.reply(step, eos[0], pad[0])
            return part.to(device, talker.dtype).reshape(1, 1, -1)

        group: list[int] = []
        size = self.args.codes_per_chunk

        def on_code(code: int) -> None:
            group.append(code)
            if len(group) >= size and not run.stopped.is_set():
                run.emit(group.copy())
                group.clear()

        args = self.args
        sampling = Sampling(args.do_sample, self._eos, args.max_new_tokens)
        with torch.no_grad():
            # The prompt's step and the first code: transformers' generate, which infers
            # the attention mask and builds the logits processors (kept by ``capture``).
            criteria = stop_criteria(run)
            criteria.append(first_code())
            with PrefillCapture(talker) as capture:
                codes = talker.generate(
                    **inputs,
                    thinker_reply_part=pad,
                    attention_mask=None,
                    suppress_tokens=[talker.codec_bos_token],
                    max_new_tokens=args.max_new_tokens,
                    do_sample=args.do_sample,
                    top_k=args.top_k,
                    top_p=args.top_p,
                    temperature=args.temperature,
                    eos_token_id=sorted(self._eos),
                    pad_token_id=talker.codec_pad_token,
                    repetition_penalty=args.repetition_penalty,
                    stopping_criteria=criteria,
                )
            first = int(codes[0, -1])
            if first in self._eos or run.stopped.is_set():
                return
            on_code(first)
            decode_rest(talker, capture, codes, sampling, reply, on_code, run.stopped.is_set)
        if group and not run.stopped.is_set():
            run.emit(group)

    async def _read(self, inputs: AsyncIterator[StageInput], feed: ReplyFeed) -> None:
        """The thinker's tensors into ``feed`` as they come; its text is the client's."""
        try:
            async for chunk in inputs:
                self.progress += 1  # input taken in: waiting on the thinker is not a stall
                if isinstance(chunk.meta, TensorMeta) and chunk.data:
                    feed.put(chunk.meta.name, chunk_tensor(chunk.meta, chunk.data))
        finally:
            feed.end()

    async def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _long(values: list[int]) -> Any:
    import torch

    return torch.tensor(values, dtype=torch.long)
