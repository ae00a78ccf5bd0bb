"""Constrained decoding: a grammar (from a JSON schema) decides which tokens may come next.

Built on llguidance, the grammar engine vLLM and llama.cpp use: it compiles a JSON
schema to a grammar over the tokenizer's byte strings, and for every step gives a
bitmask of the tokens that keep the text a valid prefix (about a millisecond for this
vocabulary). The sampler masks the logits with it, so the output always parses and
matches the schema; once the grammar is complete only end-of-sequence is allowed.

Whitespace between JSON tokens is not allowed (compact output): a small model left free
to choose may otherwise fill its whole budget with newlines.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import torch

from omnistage.protocol.errors import BadRequestError, EngineError

_JSON_OPTIONS = {"whitespace_flexible": False}


class TokenVocabulary:
    """The tokenizer as llguidance sees it (built once per engine, ~0.3 s), which also
    gives each token's exact bytes for logprobs."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        try:
            import llguidance.hf
        except ImportError as exc:  # pragma: no cover - a models-extra dependency
            raise EngineError(
                "constrained decoding needs the llguidance package: pip install llguidance"
            ) from exc
        self.vocab_size = vocab_size
        self.ll = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self._texts: dict[int, tuple[str, list[int]]] = {}
        self._lock = threading.Lock()

    def token(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text (undecodable bytes replaced) and its exact bytes."""
        got = self._texts.get(token_id)
        if got is None:
            raw = self.ll.decode_bytes([token_id])
            got = (raw.decode("utf-8", errors="replace"), list(raw))
            with self._lock:
                self._texts[token_id] = got
        return got


class Guide:
    """One request's grammar state; implements ``sampling.Constraint``."""

    def __init__(self, vocab: TokenVocabulary, grammar: str, param: str) -> None:
        from llguidance import LLMatcher

        self._vocab = vocab
        self._matcher = LLMatcher(vocab.ll, grammar, log_level=0)
        if self._matcher.is_error():
            raise BadRequestError(f"{param}: {self._matcher.get_error()}", param)
        self._param = param

    def allowed(self) -> torch.Tensor:
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self._vocab.vocab_size]
        return torch.from_numpy(mask.astype(bool))

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(token) and not self._matcher.is_stopped():
            raise EngineError(f"grammar refused token {token}: {self._matcher.get_error()}")

    def replay(self, tokens: list[int]) -> None:
        """Feed tokens generated before a retry (the text the client already has)."""
        if tokens and not self._matcher.consume_tokens(tokens):
            raise EngineError(
                f"the continued output does not fit the grammar: {self._matcher.get_error()}"
            )

    @property
    def complete(self) -> bool:
        """The text is complete and nothing may follow."""
        return self._matcher.is_stopped()


def json_grammar(schema: dict[str, Any], param: str) -> str:
    """An llguidance grammar for JSON values matching ``schema``."""
    from llguidance import LLMatcher

    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except ValueError as exc:
        raise BadRequestError(f"{param}: {exc}", param) from None


def schema_of_response_format(value: Any) -> dict[str, Any] | None:
    """The JSON schema OpenAI's ``response_format`` asks for (None: free text)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise BadRequestError("response_format must be an object with a type", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None and isinstance(spec, dict):
            schema = {"type": "object"}  # OpenAI allows a name without a schema
        if not isinstance(schema, dict):
            raise BadRequestError(
                "response_format.json_schema.schema must be a JSON schema object",
                "response_format",
            )
        return schema
    raise BadRequestError(
        f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
        "response_format",
    )


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
