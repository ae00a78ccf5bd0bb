"""The LLM step loop: continuous batching on a thread of its own.

Every iteration: drop aborted sequences (freeing their cache rows at once), admit
waiting ones while the batch has room (prefill each, sample its first token, add its
cache as a row), then decode one token for every running sequence in a single forward
pass. Sequences join and leave between any two steps. The model and its KV cache are a
``Batch``: the fast CPU thinker's or a transformers model's, the loop is the same.

Results go back to the asyncio side through each sequence's ``deliver`` callback,
which must be thread-safe (the engine passes ``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from omnistage.engines.base import EngineChunk
from omnistage.engines.llm.detok import Detokenizer
from omnistage.engines.llm.prefix_cache import PrefixCache
from omnistage.engines.llm.sampling import Sampler
from omnistage.engines.llm.stream_pace import StreamPace
from omnistage.engines.torch_threads import ThreadTuner, TorchThread, use_threads
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.messages import TokenLogprob, TopLogprob, Usage

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
    # Last prompt tokens (a resumed continuation) to compute as decode steps, where the
    # batch can: a seeded draw then sees the logits the uninterrupted run saw.
    replay: int = 0
    generated: list[int] = field(default_factory=list)
    # Prompt tokens whose KV came from the prefix cache (usage's cached_tokens).
    cached_tokens: int = 0
    # Prompt prefix end -> the prefix key of the chat messages it holds (prefix_labels).
    prefix_labels: dict[int, int] = field(default_factory=dict)
    # The prefix key of the prompt's messages plus this answer (its text -> the key),
    # for the answer's prefix cache entry; None: the answer is not labelled.
    answer_key: Callable[[str], int] | None = None
    # Logprobs of tokens whose text has not gone out yet (held back by detokenizing).
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    logprob_chars: int = 0  # text length of the tokens whose logprobs went out
    # Holds text delivered within an interval of the last delivery (None: every
    # token goes out as it comes).
    pace: StreamPace | None = None
    aborted: bool = False
    done: bool = False

    @property
    def projected_len(self) -> int:
        return len(self.prompt_ids) + self.max_tokens


class Batch(Protocol):
    """The model and KV cache of the running rows (``kv_batch.HfBatch`` for any
    transformers model, ``slot_batch.SlotBatch`` for the fast CPU thinker)."""

    # Prompt positions the last ``prefill`` took from a prefix cache (0 without one).
    prefill_cached: int
    # The prefix cache, if the batch keeps one (the engine reports the keys it holds).
    prefixes: PrefixCache | None

    @property
    def rows(self) -> int: ...

    @property
    def positions(self) -> list[int]:
        """Each row's next position id."""
        ...

    def prefill(
        self, ids: list[int], replay: int = 0, labels: Mapping[int, int] | None = None
    ) -> torch.Tensor:
        """Next-token logits [vocab] of a prompt, its cache staged for ``admit``; a
        prefix cache keeps ``labels`` (prefix end -> prefix key) with its entries.

        ``replay``: compute that many last tokens as decode steps, as the run that
        generated them did (a resumed seeded request then draws the same); a batch that
        cannot prefills them with the rest."""
        ...

    def remember(self, row: int, ids: list[int], label: int | None = None) -> None:
        """Keep ``row``'s KV, which holds ``ids`` (a prompt and its answer), for a
        later prompt that goes on from it, if the batch keeps a prefix cache."""
        ...

    def admit(self, first_token: int) -> None:
        """The staged prompt joins as the last row."""
        ...

    def decode(self) -> torch.Tensor:
        """Logits [rows, vocab] of every row's next token."""
        ...

    def advance(self, tokens: list[int]) -> None: ...

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (ascending); the others' cache is released."""
        ...

    def reset(self) -> None: ...


@dataclass(frozen=True)
class BatchLimits:
    max_num_seqs: int
    max_kv_tokens: int
    max_model_len: int


class LlmWorker:
    def __init__(
        self,
        batch: Batch,
        eos_ids: set[int],
        limits: BatchLimits,
        on_step: Callable[[], None],
        tuner: ThreadTuner | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._batch = batch
        # The batch may place the threads (our kernel's own, or torch's): see FastLlama.
        self._use_threads: Callable[[int], None] = getattr(batch, "use_threads", use_threads)
        # Picks the torch thread count from the decode steps' times (None: fixed).
        self._tuner = tuner
        self._clock = clock
        self._eos = eos_ids
        self.limits = limits
        self._on_step = on_step
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._stop = False
        self.steps = 0
        self._loop: Future | None = None

    # -- called from the event loop ---------------------------------------------------

    def start(self, thread: TorchThread) -> None:
        """Run the step loop on ``thread``: the one that loaded the model."""
        self._loop = thread.run(self._run)

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
        if self._loop is not None:
            concurrent.futures.wait([self._loop], timeout=10)

    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    # -- the loop (worker thread) -----------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        self._use_threads(self._tuner.count if self._tuner is not None else torch.get_num_threads())
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
            self._send_held()  # a prefill may take long: what is held goes first
            self._prefill(seq)

    def _fits(self, seq: Sequence) -> bool:
        """Padded KV bound: every row is as long as the longest projected sequence."""
        longest = max([seq.projected_len, *(s.projected_len for s in self._running)])
        return (len(self._running) + 1) * longest <= self.limits.max_kv_tokens

    def _prefill(self, seq: Sequence) -> None:
        logits = self._batch.prefill(seq.prompt_ids, replay=seq.replay, labels=seq.prefix_labels)
        seq.cached_tokens = self._batch.prefill_cached
        token = seq.sampler.sample(logits, seq.prior_tokens)
        self._tick()
        if self._accept(seq, token, position=len(seq.prompt_ids)):
            self._batch.admit(token)
            self._running.append(seq)

    def _decode_step(self) -> None:
        started = self._clock()
        logits = self._batch.decode()
        if self._tuner is not None:
            self._use_threads(self._tuner.observe(len(self._running), self._clock() - started))
        tokens = [
            s.sampler.sample(logits[i], s.prior_tokens + len(s.generated))
            for i, s in enumerate(self._running)
        ]
        self._batch.advance(tokens)
        self._tick()
        for row, (seq, token) in enumerate(zip(self._running, tokens, strict=True)):
            self._accept(seq, token, position=self._batch.positions[row], row=row)
        # Finished rows leave before the next step (in _drop_aborted).

    def _tick(self) -> None:
        self.steps += 1
        self._on_step()

    def _accept(self, seq: Sequence, token: int, position: int, row: int | None = None) -> bool:
        """Record one sampled token (``row``: the sequence's batch row, once it has
        one); True while the sequence goes on."""
        if seq.aborted:
            seq.done = True
            return False
        finish: FinishReason | None = None
        delta = ""
        # What the row holds when the answer is whole: the answer's every token, or all
        # but the last when max_tokens cut it (the last was sampled, never fed back).
        held = None
        if token in self._eos:
            finish = FinishReason.STOP
            held = seq.generated
        else:
            seq.generated.append(token)
            if seq.token_text is not None:
                seq.pending_logprobs.append(_logprob(seq, token))
            delta = seq.detok.add(token)
            constraint = seq.sampler.constraint
            if seq.detok.stopped or (constraint is not None and constraint.complete):
                finish = FinishReason.STOP  # a complete grammar allows nothing but the end
            elif len(seq.generated) >= seq.max_tokens or position + 1 >= self.limits.max_model_len:
                finish = FinishReason.LENGTH
                held = seq.generated[:-1]
        if finish is None:
            if delta:
                # Usage so far rides along: a retry then knows how many tokens the
                # delivered text took, which re-encoding it may not tell (see Resume).
                chunk = EngineChunk(Modality.TEXT, text=delta, usage=_usage(seq))
                chunk.logprobs = _take_logprobs(seq)
                self._send(seq, chunk)
            return True
        seq.done = True
        last = EngineChunk(
            Modality.TEXT,
            text=delta + seq.detok.finish(),
            finished=True,
            finish_reason=finish,
            usage=_usage(seq),
            logprobs=_take_logprobs(seq, final=True),
        )
        if row is not None and held:
            # A conversation's next prompt starts with this prompt and answer: kept
            # (labelled with the text the client got) before the client hears the end.
            label = seq.answer_key(seq.detok.text) if seq.answer_key else None
            self._batch.remember(row, seq.prompt_ids + held, label)
        self._send(seq, last)
        return False

    def _send(self, seq: Sequence, chunk: EngineChunk) -> None:
        if seq.pace is not None:
            paced = seq.pace.offer(chunk, self._clock())
            if paced is None:
                return
            chunk = paced
        seq.deliver(chunk)

    def _send_held(self) -> None:
        now = self._clock()
        for seq in self._running:
            held = seq.pace.take(now) if seq.pace is not None else None
            if held is not None and not seq.aborted:
                seq.deliver(held)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            victims = [*self._running, *self._waiting]
            self._waiting.clear()
        self._running = []
        self._batch.reset()
        for seq in victims:
            if not seq.done:
                seq.done = True
                held = seq.pace.take(self._clock()) if seq.pace is not None else None
                if held is not None:
                    seq.deliver(held)  # text it generated, then the failure
                seq.deliver(exc)


def _usage(seq: Sequence) -> Usage:
    prompt = seq.prompt_tokens or len(seq.prompt_ids)
    generated = seq.prior_tokens + len(seq.generated)
    return Usage(prompt, generated, cached_tokens=min(seq.cached_tokens, prompt))


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
