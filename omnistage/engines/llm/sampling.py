"""Per-request sampling: OpenAI parameters in, one token id out per step."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.params import GenerationParams

_T = TypeVar("_T")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    # Alternatives reported per token; None: no logprobs at all, 0: the chosen one only.
    logprobs: int | None = None
    # End-of-sequence is not allowed before this many tokens (ignore_eos: never).
    min_tokens: int = 0
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_params(cls, params: GenerationParams, default_max_tokens: int) -> SamplingParams:
        """The engine's view of a request's params: defaults filled in, OpenAI's
        spellings resolved. Ranges were checked where the params were decoded
        (``protocol.params``); what is left to check needs more than one field."""
        stop = params.stop or ()
        top_k = params.top_k or 0
        return cls(
            logprobs=_logprobs(params),
            min_tokens=params.min_tokens or 0,
            ignore_eos=bool(params.ignore_eos),
            logit_bias=_logit_bias(params.logit_bias),
            temperature=_or(params.temperature, 1.0),
            top_p=_or(params.top_p, 1.0),
            top_k=max(0, top_k),
            max_tokens=_or(params.max_tokens, default_max_tokens),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            seed=params.seed,
            presence_penalty=_or(params.presence_penalty, 0.0),
            frequency_penalty=_or(params.frequency_penalty, 0.0),
            repetition_penalty=_or(params.repetition_penalty, 1.0),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _or(value: _T | None, default: _T) -> _T:
    return default if value is None else value


def _logprobs(params: GenerationParams) -> int | None:
    """Chat's ``logprobs: true`` + ``top_logprobs: k``, or completions' ``logprobs: k``."""
    wanted = params.logprobs
    if wanted is None or wanted is False:
        if params.top_logprobs:
            raise BadRequestError("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    if wanted is True:
        return params.top_logprobs or 0
    return wanted


def _logit_bias(value: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    return tuple((int(token), float(bias)) for token, bias in (value or {}).items())


class Constraint(Protocol):
    """What the sampler asks of a grammar (see ``guided.Guide``)."""

    def allowed(self) -> torch.Tensor:
        """A bool mask over the vocabulary: the tokens the grammar allows next."""
        ...

    def advance(self, token: int) -> None: ...

    @property
    def complete(self) -> bool:
        """Nothing may follow: the text is finished."""
        ...


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def counter_uniform(seed: int, index: int) -> float:
    """A uniform in [0, 1) from (seed, index) alone (SplitMix64 of both): counter-based,
    no RNG state to carry across steps or replicas."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ index) >> 11) * 2.0**-53


def _draw(probs: torch.Tensor, u: float) -> int:
    """Inverse CDF: the token whose cumulative mass first exceeds ``u`` of the total
    (never a token of zero mass). Float64 sums: the same probabilities always give the
    same token."""
    cdf = probs.double().cumsum(0)
    target = torch.tensor([u], dtype=torch.float64) * cdf[-1]
    index = int(torch.searchsorted(cdf, target, right=True))
    return min(index, probs.shape[0] - 1)


# A top-p nucleus is looked for among this many most likely tokens first: sorting the
# whole vocabulary (49,152 for SmolLM2) per row per step cost more than the draw.
NUCLEUS_CANDIDATES = 256


def nucleus_full(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The vocabulary sorted by probability (stable: bfloat16 logits tie often, and
    the order must not vary) with the mass outside the top-p nucleus zeroed, and the
    token of each position."""
    probs, order = torch.sort(probs, descending=True, stable=True)
    # Keep the smallest prefix whose mass reaches top_p (always the first).
    drop = torch.cumsum(probs, dim=-1) - probs > top_p
    return probs.masked_fill(drop, 0.0), order


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``nucleus_full``'s nucleus, in the same order, from the ``NUCLEUS_CANDIDATES``
    most likely tokens when they hold it: then only those are returned (the rest would
    be zeros). They hold it when it ends above the least of them, so that no token
    tied with one of it was left out; otherwise the whole vocabulary is sorted."""
    if probs.shape[-1] <= NUCLEUS_CANDIDATES:
        return nucleus_full(probs, top_p)
    values, ids = torch.topk(probs, NUCLEUS_CANDIDATES)
    # Ties in the order a stable sort of the whole vocabulary gives: by token id.
    ids, by_id = torch.sort(ids)
    values, by_value = torch.sort(values[by_id], descending=True, stable=True)
    ids = ids[by_value]
    keep = torch.cumsum(values, dim=-1) - values <= top_p
    last = int(keep.sum()) - 1  # the nucleus is a prefix: keep is true, then false
    if last == NUCLEUS_CANDIDATES - 1 or not values[last] > values[-1]:
        return nucleus_full(probs, top_p)
    return values.masked_fill(~keep, 0.0), ids


class Sampler:
    """Sampling state of one sequence: the counts penalties need, an
    optional grammar constraint, and the logprobs of the last token when asked."""

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        device: torch.device,
        constraint: Constraint | None = None,
        eos_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.params = params
        self.constraint = constraint
        for token, _ in params.logit_bias:
            if token >= vocab_size:
                raise BadRequestError(f"logit_bias: no token {token}", "logit_bias")
        self._vocab_size, self._device = vocab_size, device
        self._eos = torch.tensor(sorted(i for i in eos_ids if i < vocab_size), device=device)
        # The vocabulary-wide tensors are made by the first ``sample``, on the engine's
        # torch thread: filling one is parallel work, and parallel work started on the
        # event loop's thread would give OpenMP a second pool (see torch_threads.TorchThread).
        self._bias: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self._replayed: list[int] = []
        self._penalize = bool(params.presence_penalty or params.frequency_penalty)
        # Repetition penalty: the tokens seen so far, the prompt's included (HF's and
        # vLLM's semantics), as a mask over the vocabulary.
        self._context: list[int] = []
        self._seen: torch.Tensor | None = None
        # (chosen token's logprob, [(token, logprob), ...] best first) of the last sample.
        self.last_logprobs: tuple[float, list[tuple[int, float]]] | None = None

    def replay(self, tokens: list[int]) -> None:
        """Count tokens generated before a resume (by the failed replica): penalties
        then see the whole completion, as the uninterrupted run's did."""
        self._replayed.extend(tokens)

    def read(self, prompt: list[int]) -> None:
        """The prompt's tokens, which a repetition penalty counts as seen."""
        if self.params.repetition_penalty != 1.0:
            self._context.extend(prompt)

    def _vocab_tensors(self) -> None:
        if self.params.logit_bias and self._bias is None:
            self._bias = torch.zeros(self._vocab_size, device=self._device)
            for token, bias in self.params.logit_bias:
                self._bias[token] = bias
        if self._penalize and self._counts is None:
            self._counts = torch.zeros(self._vocab_size, device=self._device)
            for token in self._replayed:
                if 0 <= token < self._vocab_size:
                    self._counts[token] += 1
        if self.params.repetition_penalty != 1.0 and self._seen is None:
            self._seen = torch.zeros(self._vocab_size, dtype=torch.bool, device=self._device)
            seen = [t for t in (*self._context, *self._replayed) if 0 <= t < self._vocab_size]
            if seen:
                self._seen[torch.tensor(seen, device=self._device)] = True

    def _uniform(self, index: int) -> float:
        """The uniform draw of the completion's token ``index``: with a seed, a pure
        function of (seed, index), so a request resumed at token k draws what the
        uninterrupted run drew there whatever ran before it or beside it."""
        if self.params.seed is None:
            return random.random()
        return counter_uniform(self.params.seed, index)

    def sample(self, logits: torch.Tensor, generated: int = 0) -> int:
        """One token from a 1-D logits row, ``generated`` tokens into the completion
        (the failed replica's included on a resume: min_tokens and seeded draws
        count from the start of the completion)."""
        p = self.params
        self._vocab_tensors()
        logits = logits.float()
        # Reported logprobs are the model's own, before any processing (as vLLM's).
        raw = torch.log_softmax(logits, dim=-1) if p.logprobs is not None else None
        if self._bias is not None:
            logits = logits + self._bias
        if self.constraint is not None:
            # The grammar decides where the text may end; min_tokens does not apply.
            logits = logits.masked_fill(~self.constraint.allowed(), float("-inf"))
        elif self._eos.numel() and (p.ignore_eos or generated < p.min_tokens):
            logits = logits.index_fill(0, self._eos, float("-inf"))
        if self._counts is not None:
            logits = logits - p.frequency_penalty * self._counts
            logits = logits - p.presence_penalty * (self._counts > 0).float()
        if self._seen is not None:
            r = p.repetition_penalty
            penalized = torch.where(logits > 0, logits / r, logits * r)
            logits = torch.where(self._seen, penalized, logits)
        if p.greedy:
            token = int(torch.argmax(logits))
        else:
            logits = logits / p.temperature
            if p.top_k and p.top_k < logits.shape[-1]:
                kth = torch.topk(logits, p.top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            order = None
            if p.top_p < 1.0:
                probs, order = nucleus(probs, p.top_p)
            token = _draw(probs, self._uniform(generated))
            if order is not None:
                token = int(order[token])
        if self._counts is not None:
            self._counts[token] += 1
        if self._seen is not None and token < self._vocab_size:
            self._seen[token] = True
        if raw is not None:
            top: list[tuple[int, float]] = []
            if p.logprobs:
                values, ids = torch.topk(raw, p.logprobs)
                top = list(zip(ids.tolist(), values.tolist(), strict=True))
            self.last_logprobs = (float(raw[token]), top)
        if self.constraint is not None:
            self.constraint.advance(token)
        return token
