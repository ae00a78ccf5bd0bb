"""The LLM step loop: continuous batching on a thread of its own.

Every iteration: drop aborted sequences (freeing their cache rows at once), admit
waiting ones while the batch has room (prefill each, sample its first token, pad its
cache into the batch), then decode one token for every running sequence in a single
forward pass. Sequences join and leave between any two steps.

Results go back to the asyncio side through each sequence's ``deliver`` callback,
which must be thread-safe (the engine passes ``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from omnistage.engines.base import EngineChunk
from omnistage.engines.llm.detok import Detokenizer
from omnistage.engines.llm.kv_batch import KvBatch
from omnistage.engines.llm.sampling import Sampler
from omnistage.protocol.messages import TokenLogprob, TopLogprob

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    sampler: Sampler
    max_tokens: int
    detok: Detokenizer
    deliver: Callable[[EngineChunk | BaseException], None]
    # For usage: the client's prompt (without a resumed continuation) and the tokens
    # generated before a retry took over.
    prompt_tokens: int = 0
    prior_tokens: int = 0
    # Token id -> (text, bytes), for logprobs (see guided.TokenVocabulary).
    token_text: Callable[[int], tuple[str, list[int]]] | None = None
    generated: list[int] = field(default_factory=list)
    # Logprobs of tokens whose text has not gone out yet (held back by detokenizing).
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    logprob_chars: int = 0  # text length of the tokens whose logprobs went out
    aborted: bool = False
    done: bool = False

    @property
    def projected_len(self) -> int:
        return len(self.prompt_ids) + self.max_tokens


@dataclass(frozen=True)
class BatchLimits:
    max_num_seqs: int
    max_kv_tokens: int
    max_model_len: int


class LlmWorker:
    def __init__(
        self,
        model: Any,
        device: torch.device,
        eos_ids: set[int],
        limits: BatchLimits,
        on_step: Callable[[], None],
    ) -> None:
        self._model = model
        self._device = device
        self._eos = eos_ids
        self.limits = limits
        self._on_step = on_step
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._cache_kw = cache_keyword(model)
        self._batch = KvBatch(self._cache_kw)
        self._stop = False
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="omni-llm", daemon=True)

    # -- called from the event loop ---------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, seq: Sequence) -> None:
        with self._cond:
            self._waiting.append(seq)
            self._cond.notify()

    def abort(self, seq: Sequence) -> None:
        seq.aborted = True
        with self._cond:
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=10)

    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    # -- the loop (worker thread) -----------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._stop and not self._waiting and not self._running:
                    self._cond.wait()
                if self._stop:
                    break
            try:
                with torch.inference_mode():
                    self._drop_aborted()
                    self._admit()
                    if self._running:
                        self._decode_step()
            except Exception as exc:  # the model failed: fail everyone, keep serving
                log.exception("LLM step failed")
                self._fail_all(exc)
        self._fail_all(RuntimeError("engine shut down"))

    def _drop_aborted(self) -> None:
        with self._cond:
            if any(s.aborted for s in self._waiting):
                self._waiting = deque(s for s in self._waiting if not s.aborted)
        keep = [i for i, s in enumerate(self._running) if not (s.aborted or s.done)]
        if len(keep) != len(self._running):
            self._batch.keep(keep)
            self._running = [self._running[i] for i in keep]

    def _admit(self) -> None:
        while len(self._running) < self.limits.max_num_seqs:
            with self._cond:
                if not self._waiting:
                    return
                seq = self._waiting[0]
                if self._running and not self._fits(seq):
                    return
                self._waiting.popleft()
            if seq.aborted:
                continue
            self._prefill(seq)

    def _fits(self, seq: Sequence) -> bool:
        """Padded KV bound: every row is as long as the longest projected sequence."""
        longest = max([seq.projected_len, *(s.projected_len for s in self._running)])
        return (len(self._running) + 1) * longest <= self.limits.max_kv_tokens

    def _prefill(self, seq: Sequence) -> None:
        n = len(seq.prompt_ids)
        cache = DynamicCache()
        out = self._model(
            input_ids=torch.tensor([seq.prompt_ids], device=self._device),
            attention_mask=torch.ones(1, n, dtype=torch.long, device=self._device),
            position_ids=torch.arange(n, device=self._device).unsqueeze(0),
            use_cache=True,
            **{self._cache_kw: cache},
        )
        token = seq.sampler.sample(out.logits[0, -1], seq.prior_tokens)
        self._tick()
        if self._accept(seq, token, position=n):
            self._batch.add(cache, n, token)
            self._running.append(seq)

    def _decode_step(self) -> None:
        out = self._model(**self._batch.step_inputs())
        logits = out.logits[:, -1, :]
        tokens = [
            s.sampler.sample(logits[i], s.prior_tokens + len(s.generated))
            for i, s in enumerate(self._running)
        ]
        self._batch.advance(tokens)
        self._tick()
        for seq, token, pos in zip(self._running, tokens, self._batch.positions, strict=True):
            self._accept(seq, token, position=pos)
        # Finished rows leave before the next step (in _drop_aborted).

    def _tick(self) -> None:
        self.steps += 1
        self._on_step()

    def _accept(self, seq: Sequence, token: int, position: int) -> bool:
        """Record one sampled token; True while the sequence goes on."""
        if seq.aborted:
            seq.done = True
            return False
        finish: str | None = None
        delta = ""
        if token in self._eos:
            finish = "stop"
        else:
            seq.generated.append(token)
            if seq.token_text is not None:
                seq.pending_logprobs.append(_logprob(seq, token))
            delta = seq.detok.add(token)
            constraint = seq.sampler.constraint
            if seq.detok.stopped or (constraint is not None and constraint.complete):
                finish = "stop"  # a complete grammar allows nothing but the end
            elif len(seq.generated) >= seq.max_tokens or position + 1 >= self.limits.max_model_len:
                finish = "length"
        if finish is None:
            if delta:
                # Usage so far rides along: a retry then knows how many tokens the
                # delivered text took, which re-encoding it may not tell (see Resume).
                chunk = EngineChunk("text", text=delta, usage=_usage(seq))
                chunk.logprobs = _take_logprobs(seq)
                seq.deliver(chunk)
            return True
        seq.done = True
        seq.deliver(
            EngineChunk(
                "text",
                text=delta + seq.detok.finish(),
                finished=True,
                finish_reason=finish,
                usage=_usage(seq),
                logprobs=_take_logprobs(seq, final=True),
            )
        )
        return False

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            victims = [*self._running, *self._waiting]
            self._waiting.clear()
        self._running = []
        self._batch = KvBatch(self._cache_kw)
        for seq in victims:
            if not seq.done:
                seq.done = True
                seq.deliver(exc)


def _usage(seq: Sequence) -> dict[str, int]:
    return {
        "prompt_tokens": seq.prompt_tokens or len(seq.prompt_ids),
        "completion_tokens": seq.prior_tokens + len(seq.generated),
    }


def _logprob(seq: Sequence, token: int) -> TokenLogprob:
    assert seq.token_text is not None and seq.sampler.last_logprobs is not None
    chosen, top = seq.sampler.last_logprobs
    text, raw = seq.token_text(token)
    alternatives = []
    for alt, logprob in top:
        alt_text, alt_raw = seq.token_text(alt)
        alternatives.append(TopLogprob(alt_text, logprob, alt_raw))
    return TokenLogprob(text, chosen, raw, alternatives)


def _take_logprobs(seq: Sequence, final: bool = False) -> list[TokenLogprob] | None:
    if not seq.pending_logprobs:
        return None
    taken, seq.pending_logprobs = seq.pending_logprobs, []
    if final and seq.detok.stopped:
        # A stop string cut the text: the tokens from the cut on were never delivered.
        room = len(seq.detok.released) - seq.logprob_chars
        kept = []
        for entry in taken:
            room -= len(entry.token)
            if room < 0:
                break
            kept.append(entry)
        taken = kept
    seq.logprob_chars += sum(len(e.token) for e in taken)
    return taken or None


def cache_keyword(model: Any) -> str:
    """transformers renamed forward(past_key_values=) to forward(cache=); use what the
    installed version takes."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
