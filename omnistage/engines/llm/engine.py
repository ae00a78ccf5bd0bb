"""The ``llm`` engine: chat or text in, streamed text deltas out, batched continuously."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from omnistage.config.engine_args import LlmArgs
from omnistage.config.schema import StageConfig
from omnistage.engines.base import Engine, EngineChunk, EngineRequest
from omnistage.engines.llm import backends
from omnistage.engines.llm.detok import Detokenizer
from omnistage.engines.llm.guided import TokenVocabulary
from omnistage.engines.llm.inputs import InputProcessor, LlmRequest, upstream_text
from omnistage.engines.llm.prefix_cache import PrefixCache
from omnistage.engines.llm.sampling import Sampler
from omnistage.engines.llm.stream_pace import StreamPace
from omnistage.engines.llm.tools import CallShaper
from omnistage.engines.llm.worker import BatchLimits, LlmWorker, Sequence
from omnistage.engines.torch_threads import ThreadTuner, TorchThread, cores, thread_ladder
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.errors import EngineError
from omnistage.protocol.messages import Usage
from omnistage.protocol.params import StageParams

log = logging.getLogger(__name__)


class OutputStream:
    """A sequence's outputs, from the step loop's thread to the request's task: the
    worker calls ``deliver`` (a chunk, or the error that ended the sequence), the task
    iterates, up to the finished chunk."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[EngineChunk | BaseException] = asyncio.Queue()
        self._finished = False

    def deliver(self, item: EngineChunk | BaseException) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> EngineChunk:
        if self._finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        self._finished = item.finished
        return item


class LlmEngine(Engine):
    supports_resume = True

    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        self.args = LlmArgs.model_validate(stage.engine_args)
        self._worker: LlmWorker | None = None
        self.tokenizer: Any = None
        self.vocabulary: TokenVocabulary | None = None
        self.max_model_len = 0
        self.backend = ""  # which backend runs the model (see backends)
        self._torch: TorchThread | None = None
        self._prefixes: PrefixCache | None = None
        self._inputs: InputProcessor | None = None

    async def start(self) -> None:
        # Loading and decoding on one thread (see TorchThread).
        self._torch = TorchThread("omni-llm")
        await asyncio.wrap_future(self._torch.run(self._load))

    def _load(self) -> None:
        import torch

        threads = self.args.torch_threads or cores()
        torch.set_num_threads(threads)
        # No count given: the step loop picks one by timing itself (see threads).
        tuner = None if self.args.torch_threads else ThreadTuner(thread_ladder(threads))
        self.starting = f"loading weights of {self.args.model} (a first start converts a GGUF)"
        model = backends.load(self.args)
        self.backend = model.backend
        self.kernel = model.kernel
        self.tokenizer = model.tokenizer
        self._vocab = model.vocab
        self._torch_device = model.device
        self.max_model_len = min(self.args.max_model_len or model.window, model.window)
        self._eos_ids = model.eos_ids
        # Grammars and logprobs see tokens as bytes through it.
        self.starting = "indexing the vocabulary for constrained decoding"
        self.vocabulary = TokenVocabulary(self.tokenizer, self._vocab)
        prefixes = model.batch.prefixes
        if prefixes is not None and prefixes.budget_tokens > 0:
            self._prefixes = prefixes
        self._inputs = InputProcessor(
            self.args,
            self.tokenizer,
            self.vocabulary,
            self.max_model_len,
            self._eos_ids,
            label_prefixes=self._prefixes is not None,
            model_sampling=model.sampling,
        )
        limits = BatchLimits(self.args.max_num_seqs, self.args.max_kv_tokens, self.max_model_len)
        self._worker = LlmWorker(model.batch, set(self._eos_ids), limits, self._count_step, tuner)
        assert self._torch is not None
        self._worker.start(self._torch)
        log.info(
            "llm ready (%s, %s): window %d tokens, up to %d sequences per step, %s torch threads",
            self.backend,
            self.kernel,
            self.max_model_len,
            limits.max_num_seqs,
            threads if tuner is None else f"1-{threads} (tuned)",
        )

    def _count_step(self) -> None:
        self.progress += 1

    @property
    def queue_length(self) -> int:
        return self._worker.queue_length if self._worker else 0

    def cached_prefixes(self) -> tuple[int, tuple[int, ...]] | None:
        # Swapped whole by the step loop's thread: safe to read from the heartbeat's.
        return self._prefixes.published if self._prefixes is not None else None

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        worker, inputs = self._started()
        req = inputs.process(request, await upstream_text(request.inputs))
        if req.already_done:
            usage = Usage(len(req.prompt_ids), req.resume.tokens, cached_tokens=0)
            yield EngineChunk(
                Modality.TEXT, finished=True, finish_reason=FinishReason.LENGTH, usage=usage
            )
            return
        outputs = OutputStream()
        seq = self._sequence(req, outputs.deliver)
        shaper = CallShaper(req.plan, req.resume.text)
        worker.submit(seq)
        try:
            async for chunk in outputs:
                for out in shaper.shape(chunk):
                    yield out
        finally:
            if not seq.done:
                worker.abort(seq)  # frees its batch row before the next step

    def _sequence(
        self, req: LlmRequest, deliver: Callable[[EngineChunk | BaseException], None]
    ) -> Sequence:
        """The step loop's row state for a request; its outputs go to ``deliver``."""
        params, prior = req.sampling, req.resume.ids
        sampler = Sampler(params, self._vocab, self._torch_device, req.guide, self._eos_ids)
        # Penalties count the delivered tokens too; seeded draws and min_tokens go by
        # the token's index in the whole completion (prior_tokens on).
        sampler.replay(prior)
        sampler.read(req.prompt_ids)
        interval = self.args.stream_interval_ms / 1000
        return Sequence(
            request_id=req.request_id,
            prompt_ids=req.ids,
            sampler=sampler,
            max_tokens=req.max_tokens,
            detok=Detokenizer(self.tokenizer, params.stop),
            deliver=deliver,
            prompt_tokens=len(req.prompt_ids),
            prior_tokens=req.resume.tokens,
            prefix_labels=req.prefix_labels,
            answer_key=req.answer_key,
            # Seeded sampling draws by token index; the logits must match too (greedy
            # picks survive a batched prefill's rounding but for near-ties).
            replay=len(prior) if params.seed is not None and not params.greedy else 0,
            token_text=self._vocabulary().token if params.logprobs is not None else None,
            pace=StreamPace(interval) if interval > 0 else None,
        )

    def check(self, params: StageParams) -> None:
        self._started()[1].setup(params.generation)

    def _started(self) -> tuple[LlmWorker, InputProcessor]:
        if self._worker is None or self._inputs is None:
            raise EngineError("engine not started")
        return self._worker, self._inputs

    def _vocabulary(self) -> TokenVocabulary:
        if self.vocabulary is None:
            raise EngineError("engine not started")
        return self.vocabulary

    async def shutdown(self) -> None:
        if self._worker is not None:
            await asyncio.to_thread(self._worker.stop)
