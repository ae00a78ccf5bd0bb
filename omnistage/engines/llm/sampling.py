"""Per-request sampling: OpenAI parameters in, one token id out per step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


class Sampler:
    """Sampling state of one sequence: its RNG and the counts penalties need."""

    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device) -> None:
        self.params = params
        self._generator: torch.Generator | None = None
        if params.seed is not None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(params.seed)
        self._penalize = bool(params.presence_penalty or params.frequency_penalty)
        self._counts = torch.zeros(vocab_size, device=device) if self._penalize else None

    def sample(self, logits: torch.Tensor) -> int:
        """One token from a 1-D logits row."""
        p = self.params
        logits = logits.float()
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
            if p.top_p < 1.0:
                sorted_probs, order = torch.sort(probs, descending=True)
                # Keep the smallest prefix whose mass reaches top_p (always the first).
                drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs > p.top_p
                sorted_probs = sorted_probs.masked_fill(drop, 0.0)
                probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
                probs = probs / probs.sum()
            token = int(torch.multinomial(probs, 1, generator=self._generator))
        if self._counts is not None:
            self._counts[token] += 1
        return token
