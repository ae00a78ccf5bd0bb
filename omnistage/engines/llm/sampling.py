"""Per-request sampling: OpenAI parameters in, one token id out per step."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from omnistage.protocol.errors import BadRequestError


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
    # Alternatives reported per token; None: no logprobs at all, 0: the chosen one only.
    logprobs: int | None = None
    # End-of-sequence is not allowed before this many tokens (ignore_eos: never).
    min_tokens: int = 0
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_params(cls, params: dict[str, Any], default_max_tokens: int) -> SamplingParams:
        """Validate request params (already type-checked by the API, but a stage can be
        reached by other clients too)."""

        def num(name: str, default: float, lo: float, hi: float) -> float:
            value = params.get(name, default)
            if value is None:
                return default
            if not isinstance(value, int | float) or not lo <= value <= hi:
                raise BadRequestError(f"{name} must be a number in [{lo}, {hi}]", name)
            return float(value)

        stop = params.get("stop") or ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
            raise BadRequestError("stop must be a non-empty string or a list of them", "stop")
        if len(stop) > 4:
            raise BadRequestError("at most 4 stop sequences", "stop")
        max_tokens = params.get("max_tokens")
        if max_tokens is None:
            max_tokens = default_max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequestError("max_tokens must be a positive integer", "max_tokens")
        top_k = params.get("top_k") or 0
        if not isinstance(top_k, int) or top_k < -1:
            raise BadRequestError("top_k must be an integer >= -1", "top_k")
        seed = params.get("seed")
        if seed is not None and not isinstance(seed, int):
            raise BadRequestError("seed must be an integer", "seed")
        return cls(
            logprobs=_logprobs(params),
            min_tokens=_count(params, "min_tokens"),
            ignore_eos=_flag(params, "ignore_eos"),
            logit_bias=_logit_bias(params.get("logit_bias")),
            temperature=num("temperature", 1.0, 0.0, 2.0),
            top_p=num("top_p", 1.0, 1e-6, 1.0),
            top_k=max(0, top_k),
            max_tokens=max_tokens,
            stop=tuple(stop),
            seed=seed,
            presence_penalty=num("presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=num("frequency_penalty", 0.0, -2.0, 2.0),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# OpenAI's limit on top_logprobs.
MAX_TOP_LOGPROBS = 20


def _flag(params: dict[str, Any], name: str) -> bool:
    value = params.get(name) or False
    if not isinstance(value, bool):
        raise BadRequestError(f"{name} must be true or false", name)
    return value


def _count(params: dict[str, Any], name: str) -> int:
    value = params.get(name) or 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequestError(f"{name} must be a non-negative integer", name)
    return value


def _logprobs(params: dict[str, Any]) -> int | None:
    """Chat's ``logprobs: true`` + ``top_logprobs: k``, or completions' ``logprobs: k``."""
    wanted = params.get("logprobs")
    if wanted is None or wanted is False:
        if params.get("top_logprobs"):
            raise BadRequestError("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    if wanted is True:
        top, name = _count(params, "top_logprobs"), "top_logprobs"
    else:
        top, name = wanted, "logprobs"
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise BadRequestError(f"{name} must be an integer from 0 to {MAX_TOP_LOGPROBS}", name)
    return top


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    if not value:
        return ()
    if not isinstance(value, dict):
        raise BadRequestError("logit_bias must map token ids to numbers", "logit_bias")
    out = []
    for key, bias in value.items():
        token = str(key)
        if not (token.isascii() and token.isdigit()):
            raise BadRequestError(f"logit_bias: {key!r} is not a token id", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise BadRequestError("logit_bias values must be from -100 to 100", "logit_bias")
        out.append((int(token), float(bias)))
    return tuple(out)


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
        # (chosen token's logprob, [(token, logprob), ...] best first) of the last sample.
        self.last_logprobs: tuple[float, list[tuple[int, float]]] | None = None

    def replay(self, tokens: list[int]) -> None:
        """Count tokens generated before a resume (by the failed replica): penalties
        then see the whole completion, as the uninterrupted run's did."""
        self._replayed.extend(tokens)

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
                # Stable: bfloat16 logits tie often, and the order must not vary.
                probs, order = torch.sort(probs, descending=True, stable=True)
                # Keep the smallest prefix whose mass reaches top_p (always the first).
                drop = torch.cumsum(probs, dim=-1) - probs > p.top_p
                probs = probs.masked_fill(drop, 0.0)
            token = _draw(probs, self._uniform(generated))
            if order is not None:
                token = int(order[token])
        if self._counts is not None:
            self._counts[token] += 1
        if raw is not None:
            top: list[tuple[int, float]] = []
            if p.logprobs:
                values, ids = torch.topk(raw, p.logprobs)
                top = list(zip(ids.tolist(), values.tolist(), strict=True))
            self.last_logprobs = (float(raw[token]), top)
        if self.constraint is not None:
            self.constraint.advance(token)
        return token
