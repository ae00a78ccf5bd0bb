"""The ``vllm`` engine: vLLM's async engine (v1 ``AsyncLLM``) inside the replica.

The same contract as the ``llm`` engine, so the API and the talker work unchanged: chat or
text in (plus upstream text), streamed text deltas out with usage on every chunk, the
OpenAI sampling fields, stop strings, abort on cancellation, and exact continuation on a
retry. vLLM runs its engine core (and workers) in child processes, spawned: the replica
already runs threads, which fork would copy half-alive.

Continuation after a failed replica: the client already has ``resume_text``.
- Greedy, or sampled without a seed: the prompt plus the delivered text, re-encoded, is
  the new prompt (byte-level BPE gives back the same tokens in practice) and generation
  goes on from there, with max_tokens less what was already counted.
- Sampled with a seed: a continuation would draw different random numbers than the
  uninterrupted run (vLLM seeds one generator per request and draws from it each step),
  so the request runs again from its prompt with the same seed, and the text the client
  has is regenerated and dropped. Should it come out different (numerics of another
  batch), the engine falls back to a plain continuation from the delivered text.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from omnistage import envs
from omnistage.config.engine_args import VllmArgs
from omnistage.config.schema import StageConfig
from omnistage.engines.base import Engine, EngineChunk, EngineRequest
from omnistage.engines.llm import weights
from omnistage.engines.llm.model_defaults import read_generation_defaults, under_model
from omnistage.engines.llm.prompts import chat_ids, with_heard, with_system
from omnistage.engines.llm.sampling import SamplingParams
from omnistage.engines.llm.tools import chat_messages, plan_tools
from omnistage.engines.llm.truncation import truncate_prompt
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.errors import BadRequestError, EngineError
from omnistage.protocol.messages import Prompt, TokenLogprob, TopLogprob, Usage
from omnistage.protocol.params import GenerationParams, StageParams

log = logging.getLogger(__name__)


# Request params this engine does not serve (the llm engine's grammar-constrained
# decoding); refused with a 400 rather than silently ignored.
class _Diverged(Exception):
    """A seeded replay did not regenerate the text the client already has."""


class VllmEngine(Engine):
    supports_resume = True

    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        self.args = VllmArgs.model_validate(stage.engine_args)
        self._llm: Any = None
        self.tokenizer: Any = None
        self.max_model_len = 0
        self._vocab = 0
        self._max_num_seqs = 1
        self._active = 0
        self._ids = itertools.count()
        # The model's own sampling defaults, under everything the request brings (vLLM
        # applies them only in its own OpenAI server, not to AsyncLLM's requests).
        self._model_sampling = GenerationParams()
        self._guard: _OrphanGuard | None = None
        self._watch: asyncio.Task[None] | None = None
        # A dead vLLM engine core leaves this replica useless: it exits so the head
        # retries its requests on another replica (and its restart policy applies).
        # Tests that run the engine in their own process turn this off.
        self.exit_when_dead = True

    async def start(self) -> None:
        self.starting = f"finding the weights of {self.args.model} (a first start converts a GGUF)"
        directory = await asyncio.to_thread(
            weights.local_model_dir, self.args.model, self.args.cache_dir
        )
        self._model_sampling = read_generation_defaults(directory)
        _prepare_environment(self.args)
        steps = "loading weights, sizing the KV cache"
        if not self.args.vllm_kwargs().get("enforce_eager"):
            steps += ", compiling (minutes on a first start)"
        self.starting = f"starting vLLM on {directory.name} ({steps})"
        before = _children()
        self._llm = await asyncio.to_thread(_build, directory, self.args)
        self._guard = _OrphanGuard(_children() - before)
        if self.exit_when_dead:
            self._watch = asyncio.create_task(self._watch_engine())
        config = self._llm.vllm_config
        self.max_model_len = int(config.model_config.max_model_len)
        self._vocab = int(config.model_config.get_vocab_size())
        self._max_num_seqs = int(config.scheduler_config.max_num_seqs)
        self.tokenizer = self._llm.get_tokenizer()
        log.info(
            "vllm ready: %s, window %d tokens, up to %d sequences per step",
            directory.name,
            self.max_model_len,
            self._max_num_seqs,
        )

    @property
    def queue_length(self) -> int:
        # vLLM schedules up to max_num_seqs at once; the rest wait in its scheduler.
        return max(0, self._active - self._max_num_seqs)

    def check(self, params: StageParams) -> None:
        self._sampling(params.generation)

    def _sampling(self, params: GenerationParams) -> SamplingParams:
        if params.tools:
            raise BadRequestError("tools is not supported by the vllm engine", "tools")
        if params.response_format and not _plain(params.response_format):
            raise BadRequestError(
                "response_format is not supported by the vllm engine", "response_format"
            )
        params = under_model(self._model_sampling, params)
        sampling = SamplingParams.from_params(params, self.args.default_max_tokens)
        for token, _ in sampling.logit_bias:
            if self._vocab and token >= self._vocab:
                raise BadRequestError(f"logit_bias: no token {token}", "logit_bias")
        return sampling

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        if self._llm is None:
            raise EngineError("engine not started")
        if self._llm.errored:
            await self._engine_died(EngineError("engine core exited"))
        heard = "".join([i.text async for i in request.inputs if i.modality == Modality.TEXT])
        prompt = with_heard(request.prompt, heard)
        if self.args.system_prompt:
            prompt = with_system(prompt, self.args.system_prompt)
        params = self._sampling(request.params.generation)
        open_end = bool(request.params.generation.continue_final_message)
        if request.params.generation.truncation == "auto":
            prompt, _ = truncate_prompt(
                prompt,
                lambda trial: len(self._prompt_ids(trial, open_end)),
                self.max_model_len,
                params.max_tokens or self.args.default_max_tokens,
            )
        ids = self._prompt_ids(prompt, open_end)
        prompt_tokens = len(ids)
        prior = self._encode(request.resume_text)
        # Tokens counted against max_tokens as the failed replica counted them.
        done = max(request.resume_tokens, len(prior)) if prior else 0
        self._check_length(len(ids) + len(prior))
        if prior and done >= params.max_tokens:
            # The failed replica had generated everything but the final message.
            usage = Usage(prompt_tokens, done)
            yield EngineChunk(
                Modality.TEXT, finished=True, finish_reason=FinishReason.LENGTH, usage=usage
            )
            return
        rid = request.request_id
        if prior and params.seed is not None and not params.greedy:
            replay = self._stream(rid, ids, params, prompt_tokens, 0, request.resume_text)
            try:
                async with contextlib.aclosing(replay) as chunks:
                    async for chunk in chunks:
                        yield chunk
                return
            except _Diverged as exc:
                log.warning("request %s: %s; continuing from the delivered text", rid, exc)
        # Closed explicitly: an abort (this generator closed) must reach vLLM now.
        async with contextlib.aclosing(
            self._stream(rid, ids + prior, params, prompt_tokens, done)
        ) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _stream(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        prompt_tokens: int,
        done: int,
        replay: str = "",
    ) -> AsyncIterator[EngineChunk]:
        """One vLLM request as engine chunks. ``done``: completion tokens already
        delivered (and in ``ids``). ``replay``: text the client already has, which this
        run (from the prompt) regenerates and drops (``_Diverged`` if it differs)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        room = self.max_model_len - len(ids)
        sampling = _vllm_sampling(params, min(params.max_tokens - done, room), done)
        # Unique per attempt: a retry of a request may reach this replica while its
        # first attempt is still being aborted.
        rid = f"{request_id}-{next(self._ids)}"
        skip, completion = replay, done
        self._active += 1
        outputs = self._llm.generate({"prompt_token_ids": ids}, sampling, rid)
        try:
            async for out in outputs:
                self.progress += 1
                piece = out.outputs[0]
                completion += len(piece.token_ids)
                text, skip = _skip(piece.text, skip)
                if skip and out.finished:
                    raise _Diverged("the seeded replay ended before the delivered text")
                logprobs = None if skip else _logprobs(piece, params.logprobs)
                usage = Usage(prompt_tokens, completion)
                if out.finished:
                    reason = (
                        FinishReason.LENGTH
                        if piece.finish_reason == FinishReason.LENGTH
                        else FinishReason.STOP
                    )
                    yield EngineChunk(
                        Modality.TEXT,
                        text,
                        finished=True,
                        finish_reason=reason,
                        usage=usage,
                        logprobs=logprobs,
                    )
                    return
                if text:
                    # Usage rides along: a retry then knows how many tokens the
                    # delivered text took (see Resume).
                    yield EngineChunk(Modality.TEXT, text, usage=usage, logprobs=logprobs)
        except EngineDeadError as exc:
            await self._engine_died(exc)
        except ValueError as exc:
            # vLLM's checks of a request (token ids, lengths) are the client's mistake.
            raise BadRequestError(str(exc)) from exc
        finally:
            self._active -= 1
            await outputs.aclose()  # aborts the request in vLLM if it is still running

    async def _watch_engine(self) -> None:
        """An idle replica notices its engine core dying too (vLLM's own monitor marks
        the client dead; requests in flight get EngineDeadError)."""
        while self._llm is not None:
            if self._llm.errored:
                await self._engine_died(EngineError("engine core exited"))
            await asyncio.sleep(1.0)

    async def _engine_died(self, exc: BaseException) -> None:
        if not self.exit_when_dead:
            raise EngineError(f"the vLLM engine died: {exc}") from exc
        log.critical("the vLLM engine died (%s); exiting so the head retries elsewhere", exc)
        await asyncio.to_thread(self._llm.shutdown)
        os._exit(1)

    def _check_length(self, length: int) -> None:
        if length >= self.max_model_len:
            # OpenAI's wording: LiteLLM and others classify the error by it.
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your messages resulted in {length} tokens. Please reduce the "
                "length of the messages.",
                "messages",
                "context_length_exceeded",
            )

    def _encode(self, text: str) -> list[int]:
        if not text:
            return []
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def _prompt_ids(self, prompt: Prompt, open_end: bool = False) -> list[int]:
        """``open_end``: the last message left open (``continue_final_message``)."""
        if prompt.messages is None:
            return [int(i) for i in self.tokenizer.encode(prompt.text or "")]
        messages = chat_messages(prompt.messages, plan_tools(GenerationParams()), False)
        return chat_ids(self.tokenizer, messages, open_end)

    async def shutdown(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._guard is not None:
            self._guard.close()
            self._guard = None
        if self._llm is not None:
            llm, self._llm = self._llm, None
            # Its output loop first: stopped after the engine core, it logs the core's
            # end as an error.
            handler = getattr(llm, "output_handler", None)
            if handler is not None:
                handler.cancel()
                await asyncio.wait([handler], timeout=5)
            await asyncio.to_thread(llm.shutdown)


# The watcher's code: wait for EOF on stdin (its parent, the replica, is gone: only the
# replica holds the write end), then kill the pids it was given.
_WATCHER = """
import os, signal, sys
sys.stdin.buffer.read()
for pid in sys.argv[1:]:
    try:
        os.kill(int(pid), signal.SIGKILL)
    except OSError:
        pass
"""


class _OrphanGuard:
    """vLLM's engine core does not notice its parent dying, so a replica killed with -9
    would leave it running (holding memory, or a GPU). A tiny watcher process, given
    vLLM's pids, kills them when the replica goes without shutting vLLM down."""

    def __init__(self, pids: set[int]) -> None:
        self._watcher = subprocess.Popen(
            [sys.executable, "-c", _WATCHER, *map(str, sorted(pids))], stdin=subprocess.PIPE
        )

    def close(self) -> None:
        """An orderly shutdown follows (vLLM stops its own processes): the watcher goes
        first, so that it never kills a pid that was reused."""
        self._watcher.kill()
        self._watcher.wait()
        if self._watcher.stdin is not None:
            self._watcher.stdin.close()


def _children() -> set[int]:
    import psutil  # a dependency of vllm

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _plain(response_format: dict[str, Any]) -> bool:
    """``response_format: {"type": "text"}`` asks for nothing special."""
    return response_format.get("type") == "text"


def _prepare_environment(args: VllmArgs) -> None:
    """vLLM reads its settings from the environment, its child processes too."""
    envs.keep_model_hubs_offline()
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if args.cpu_kvcache_space_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.cpu_kvcache_space_gib)


def _build(directory: Path, args: VllmArgs) -> Any:
    """Start vLLM (blocking: loads weights, profiles memory, spawns the engine core)."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kwargs = {"disable_log_stats": True, **args.vllm_kwargs(), "model": str(directory)}
    try:
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    except Exception as exc:
        raise EngineError(f"vLLM could not start {directory}: {exc}") from exc


def _vllm_sampling(params: SamplingParams, max_tokens: int, done: int) -> Any:
    from vllm import SamplingParams as VllmSampling
    from vllm.sampling_params import RequestOutputKind

    return VllmSampling(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        max_tokens=max(1, max_tokens),
        min_tokens=max(0, params.min_tokens - done),
        stop=list(params.stop) or None,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias) or None,
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        output_kind=RequestOutputKind.DELTA,
    )


def _skip(text: str, skip: str) -> tuple[str, str]:
    """Drop the start of ``text`` that repeats ``skip``: (what is left of the text, what
    is left to skip). ``_Diverged`` if they differ."""
    if not skip:
        return text, ""
    n = min(len(skip), len(text))
    if text[:n] != skip[:n]:
        raise _Diverged("the seeded replay differs from the delivered text")
    return text[n:], skip[n:]


def _logprobs(piece: Any, top: int | None) -> list[TokenLogprob] | None:
    """vLLM's per-token logprob maps as OpenAI's entries (the chosen token first, then
    the ``top`` most likely by rank)."""
    if top is None or not piece.logprobs:
        return None
    out = []
    for token, entries in zip(piece.token_ids, piece.logprobs, strict=False):
        chosen = entries[token]
        ranked = sorted(entries.items(), key=lambda item: item[1].rank or 0)
        alternatives = [
            TopLogprob(_piece(lp.decoded_token), lp.logprob, _bytes(lp.decoded_token))
            for _, lp in ranked
            if lp.rank is not None and lp.rank <= top
        ]
        text = _piece(chosen.decoded_token)
        out.append(TokenLogprob(text, chosen.logprob, _bytes(text), alternatives[:top]))
    return out


def _piece(text: str | None) -> str:
    return text or ""


def _bytes(text: str | None) -> list[int]:
    return list((text or "").encode())
