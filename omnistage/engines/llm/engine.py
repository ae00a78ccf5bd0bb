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
from omnistage.engines.llm.guided import (
    Guide,
    TokenVocabulary,
    json_grammar,
    schema_of_response_format,
)
from omnistage.engines.llm.prefix_cache import PrefixCache
from omnistage.engines.llm.prefix_labels import (
    rendered_turns,
    template_default_turns,
    turn_labels,
)
from omnistage.engines.llm.prompts import token_ids, with_heard, with_system
from omnistage.engines.llm.sampling import Sampler, SamplingParams
from omnistage.engines.llm.stream_pace import StreamPace
from omnistage.engines.llm.tools import CallShaper, ToolPlan, chat_messages, plan_tools
from omnistage.engines.llm.worker import BatchLimits, LlmWorker, Sequence
from omnistage.engines.torch_threads import ThreadTuner, TorchThread, cores, thread_ladder
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.errors import BadRequestError, EngineError
from omnistage.protocol.messages import ChatMessage, Prompt
from omnistage.protocol.params import GenerationParams, StageParams
from omnistage.protocol.prefix import prefix_keys

log = logging.getLogger(__name__)


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
        # Turns the chat template adds before messages (None: prompts are not labelled
        # with prefix keys; see prefix_labels).
        self._default_turns: int | None = None

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
        template = getattr(self.tokenizer, "chat_template", "") or ""
        self._template_knows_tools = "tools" in template
        prefixes = model.batch.prefixes
        if prefixes is not None and prefixes.budget_tokens > 0:
            self._prefixes = prefixes
            if template:
                self._default_turns = template_default_turns(self._render, frozenset(self._eos_ids))
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
        if self._worker is None:
            raise EngineError("engine not started")
        # Upstream text (a listener's transcript, another model's answer); none for a
        # source stage, whose inputs end at once.
        heard = "".join([i.text async for i in request.inputs if i.modality == Modality.TEXT])
        client = with_heard(request.prompt, heard)
        prompt = client
        if self.args.system_prompt:
            prompt = with_system(prompt, self.args.system_prompt)
        params, plan, guide = self._request_setup(request.params.generation)
        ids, turns = self._prompt_ids(prompt, plan)
        labels = self._prefix_labels(ids, client, turns)
        prompt_tokens = len(ids)
        # A retry continues from the prompt plus what the client already has, re-encoded
        # (byte-level BPE gives back the same tokens in practice). Those tokens count
        # against max_tokens as the failed replica counted them: under a grammar it may
        # have written the text in more tokens than re-encoding gives.
        prior = self._continuation_ids(request.resume_text)
        done = max(request.resume_tokens, len(prior)) if prior else 0
        if guide is not None:
            guide.replay(prior)
        ids += prior
        room = self.max_model_len - len(ids)
        if room < 1:
            # OpenAI's wording: LiteLLM and others classify the error by it.
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your messages resulted in {len(ids)} tokens. Please reduce the "
                "length of the messages.",
                "messages",
                "context_length_exceeded",
            )
        if prior and done >= params.max_tokens:
            # The failed replica had generated everything but the final message.
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": done, "cached_tokens": 0}
            yield EngineChunk(
                Modality.TEXT, finished=True, finish_reason=FinishReason.LENGTH, usage=usage
            )
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[EngineChunk | BaseException] = asyncio.Queue()

        def deliver(item: EngineChunk | BaseException) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        sampler = Sampler(params, self._vocab, self._torch_device, guide, self._eos_ids)
        # Penalties count the delivered tokens too; seeded draws and min_tokens go by
        # the token's index in the whole completion (prior_tokens on).
        sampler.replay(prior)
        seq = Sequence(
            request_id=request.request_id,
            prompt_ids=ids,
            sampler=sampler,
            max_tokens=min(params.max_tokens - done, room),
            detok=Detokenizer(self.tokenizer, params.stop),
            deliver=deliver,
            prompt_tokens=prompt_tokens,
            prior_tokens=done,
            prefix_labels=labels,
            answer_key=self._answer_key(client)
            if labels and not prior and not plan.offered
            else None,
            # Seeded sampling draws by token index; the logits must match too (greedy
            # picks survive a batched prefill's rounding but for near-ties).
            replay=len(prior) if params.seed is not None and not params.greedy else 0,
            token_text=self._vocabulary().token if params.logprobs is not None else None,
            pace=StreamPace(self.args.stream_interval_ms / 1000)
            if self.args.stream_interval_ms > 0
            else None,
        )
        shaper = CallShaper(plan, request.resume_text)
        self._worker.submit(seq)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                for out in shaper.shape(item):
                    yield out
                if item.finished:
                    return
        finally:
            if not seq.done:
                self._worker.abort(seq)  # frees its batch row before the next step

    def check(self, params: StageParams) -> None:
        self._request_setup(params.generation)

    def _request_setup(
        self, params: GenerationParams
    ) -> tuple[SamplingParams, ToolPlan, Guide | None]:
        """A request's sampling params, tool plan and grammar; BadRequestError if any
        of them is wrong."""
        sampling = SamplingParams.from_params(params, self.args.default_max_tokens)
        for token, _ in sampling.logit_bias:
            if token >= self._vocab:
                raise BadRequestError(f"logit_bias: no token {token}", "logit_bias")
        plan = plan_tools(params)
        schema, param = plan.schema(), "tools"
        if schema is None:
            schema, param = schema_of_response_format(params.response_format), "response_format"
        guide = None
        if schema is not None:
            guide = Guide(self._vocabulary(), json_grammar(schema, param), param)
        return sampling, plan, guide

    def _vocabulary(self) -> TokenVocabulary:
        if self.vocabulary is None:
            raise EngineError("engine not started")
        return self.vocabulary

    def _continuation_ids(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _prompt_ids(self, prompt: Prompt, plan: ToolPlan) -> tuple[list[int], int]:
        """The prompt's token ids, and the turns its chat template rendered (-1: none)."""
        tok = self.tokenizer
        if prompt.messages is not None:
            messages = chat_messages(prompt.messages, plan, self._template_knows_tools)
            if getattr(tok, "chat_template", None):
                extra: dict[str, Any] = {}
                if plan.offered and self._template_knows_tools:
                    extra["tools"] = [t.spec() for t in plan.tools]
                turns = rendered_turns(messages, self._default_turns or 0)
                return self._render(messages, **extra), turns
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
            return list(tok.encode(text)), -1
        return list(tok.encode(prompt.text or "")), -1

    def _render(self, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **extra
        )
        return token_ids(out)

    def _prefix_labels(self, ids: list[int], client: Prompt, turns: int) -> dict[int, int]:
        """Prefix end -> the prefix key of the client's messages it holds (the keys the
        head computes; turns the engine added come first and hold none of them)."""
        messages = client.messages
        if self._prefixes is None or self._default_turns is None or not messages or turns < 0:
            return {}
        keys = prefix_keys(messages)
        return turn_labels(ids, frozenset(self._eos_ids), keys, turns - len(messages))

    @staticmethod
    def _answer_key(client: Prompt) -> Callable[[str], int]:
        """The prefix key a conversation's next request gives its messages up to this
        answer: the client sends the answer back as an assistant message's content."""
        messages = list(client.messages or ())

        def key(text: str) -> int:
            return prefix_keys([*messages, ChatMessage("assistant", text)])[-1]

        return key

    async def shutdown(self) -> None:
        if self._worker is not None:
            await asyncio.to_thread(self._worker.stop)
