"""Resuming an llm request on the real SmolLM2-135M-Instruct weights, in-process.

A retry after a replica failure hands the engine what the client already has
(``resume_text``); with greedy sampling the resumed run must produce exactly the rest of
what an uninterrupted run produces, and account its usage as if nothing had happened.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from omnistage.config.schema import StageConfig
from omnistage.engines.base import EngineChunk, EngineRequest, StageInput
from omnistage.engines.llm.engine import LlmEngine
from omnistage.protocol.messages import ChatMessage, Prompt
from tests import params as P

pytestmark = pytest.mark.slow

N = 24
GREEDY = {"temperature": 0, "max_tokens": N}
PROMPT = "Write a short story about a robot who learns to paint."


async def _no_inputs() -> AsyncIterator[StageInput]:
    return
    yield  # pragma: no cover


def _request(resume_text: str = "", **params: object) -> EngineRequest:
    prompt = Prompt(messages=[ChatMessage("user", PROMPT)])
    return EngineRequest("r", prompt, P.text({**GREEDY, **params}), _no_inputs(), resume_text)


def _run(engine: LlmEngine, request: EngineRequest) -> list[EngineChunk]:
    async def main() -> list[EngineChunk]:
        return [c async for c in engine.generate(request)]

    return asyncio.run(main())


def _counts(chunk: EngineChunk) -> tuple[int, int]:
    """A chunk's prompt and completion tokens (cached_tokens depends on what the prefix
    cache held at the time, not on the request)."""
    assert chunk.usage is not None
    return chunk.usage.prompt_tokens, chunk.usage.completion_tokens


def _text(chunks: list[EngineChunk]) -> str:
    return "".join(c.text for c in chunks)


@pytest.fixture(scope="module")
def engine() -> Iterator[LlmEngine]:
    # One engine for the module: loading the weights is most of the cost. Its worker
    # is a thread and each generate call binds to the running loop, so separate
    # asyncio.run calls can share it.
    eng = LlmEngine(StageConfig(stage_id=0, name="thinker", engine="llm", engine_args={}))
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def original(engine: LlmEngine) -> list[EngineChunk]:
    chunks = _run(engine, _request())
    last = chunks[-1]
    # The prompt asks for a story: 24 tokens end by length, not by EOS, so every
    # resumed run below has tokens left to generate.
    assert last.finished and last.finish_reason == "length"
    assert last.usage is not None and last.usage.completion_tokens == N
    return chunks


def _cut_at_word(text: str, fraction: float) -> int:
    """The index of the space nearest below ``fraction`` of ``text``: the delivered
    part ends before a space, as a token boundary of byte-level BPE does (a token
    carries its leading space, so "... the" + " robot" re-encodes to the same tokens,
    while a trailing space would encode as a token of its own)."""
    cut = text.rfind(" ", 0, int(len(text) * fraction))
    assert cut > 0, text
    return cut


@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.8])
def test_greedy_resume_continues_with_exactly_the_rest_of_the_output(
    engine: LlmEngine, original: list[EngineChunk], fraction: float
) -> None:
    full = _text(original)
    cut = _cut_at_word(full, fraction)
    delivered, rest = full[:cut], full[cut:]
    resumed = _run(engine, _request(resume_text=delivered))
    # Greedy decoding from prompt + the re-encoded delivered tokens is the same
    # computation as the uninterrupted run (the re-encoding gives back the same tokens),
    # so the continuation is exact, not merely similar.
    assert _text(resumed) == rest
    last, first_usage = resumed[-1], original[-1].usage
    assert last.finished and last.finish_reason == "length"
    # Usage as if no replica had failed: the client's prompt (not prompt + delivered
    # text), and every completion token, the earlier replica's included.
    assert _counts(last) == _counts(original[-1])
    assert last.usage is not None and first_usage is not None
    assert last.usage.prompt_tokens == first_usage.prompt_tokens
    assert last.usage.completion_tokens == N


def test_delivered_tokens_count_against_max_tokens(
    engine: LlmEngine, original: list[EngineChunk]
) -> None:
    full = _text(original)
    delivered = full[: _cut_at_word(full, 0.5)]
    prior = len(engine.tokenizer.encode(delivered, add_special_tokens=False))
    steps = engine.progress
    resumed = _run(engine, _request(resume_text=delivered))
    new_tokens = len(engine.tokenizer.encode(_text(resumed), add_special_tokens=False))
    assert prior + new_tokens == N
    # Only the new tokens were decoded (one step each), not the whole answer again.
    assert engine.progress - steps == N - prior


def test_resume_with_every_token_already_delivered_ends_at_once_by_length(
    engine: LlmEngine, original: list[EngineChunk]
) -> None:
    # The failed replica generated all max_tokens but its final message was lost.
    full = _text(original)
    steps = engine.progress
    chunks = _run(engine, _request(resume_text=full))
    assert engine.progress == steps  # nothing was submitted to the model
    (last,) = chunks
    assert (last.text, last.finished, last.finish_reason) == ("", True, "length")
    assert _counts(last) == _counts(original[-1])


def test_resume_past_a_smaller_max_tokens_also_ends_at_once(
    engine: LlmEngine, original: list[EngineChunk]
) -> None:
    full = _text(original)
    chunks = _run(engine, _request(resume_text=full, max_tokens=N // 2))
    (last,) = chunks
    assert (last.text, last.finish_reason) == ("", "length")


# Seeded sampling: each token's draw is a pure function of (seed, its index in the
# completion), so a resumed request draws at token k what the uninterrupted one drew.
SEEDED = {"temperature": 1.0, "top_p": 0.9, "seed": 7, "max_tokens": 40, "ignore_eos": True}
OTHERS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child.",
)


@pytest.fixture(scope="module")
def seeded(engine: LlmEngine) -> list[EngineChunk]:
    # The cuts must include one inside a word. Which seeds give such an answer depends
    # on the CPU's kernels (ours or torch's int4 matmul round differently), so take the
    # first seed from 7 that does; SEEDED then says it for every test here.
    for seed in range(7, 27):
        SEEDED["seed"] = seed
        chunks = _run(engine, _request(**SEEDED))
        if _mid_word(chunks):
            break
    last = chunks[-1]
    assert last.finished and last.finish_reason == "length"
    return chunks


def _mid_word(chunks: list[EngineChunk]) -> list[int]:
    """Chunk boundaries inside a word (the next chunk goes on without a space)."""
    # The last chunk finishes the request: a cut there leaves nothing to resume.
    return [
        i
        for i in range(1, len(chunks) - 1)
        if chunks[i - 1].text[-1:].isalpha() and chunks[i].text[:1].isalpha()
    ]


def _cuts(chunks: list[EngineChunk]) -> list[int]:
    """Chunk boundaries to resume at (what a client can have received): early, middle,
    late, and one inside a word."""
    inner = list(range(1, len(chunks) - 1))
    mid_word = _mid_word(chunks)
    assert mid_word, [c.text for c in chunks]
    picks = {inner[len(inner) // 5], inner[len(inner) // 2], inner[4 * len(inner) // 5]}
    return sorted(picks | {mid_word[len(mid_word) // 2]})


def _resumed_request(chunks: list[EngineChunk], cut: int, rid: str = "r") -> EngineRequest:
    delivered = _text(chunks[:cut])
    usage = chunks[cut - 1].usage
    assert usage is not None
    prompt = Prompt(messages=[ChatMessage("user", PROMPT)])
    return EngineRequest(
        rid, prompt, P.text(SEEDED), _no_inputs(), delivered, usage.completion_tokens
    )


def test_seeded_resume_continues_exactly_as_the_uninterrupted_run(
    engine: LlmEngine, seeded: list[EngineChunk]
) -> None:
    full = _text(seeded)
    for cut in _cuts(seeded):
        resumed = _run(engine, _resumed_request(seeded, cut))
        assert _text(seeded[:cut]) + _text(resumed) == full, cut
        assert _counts(resumed[-1]) == _counts(seeded[-1])


def test_seeded_resume_is_exact_among_other_sequences(
    engine: LlmEngine, seeded: list[EngineChunk]
) -> None:
    # Other rows in the batch (greedy and sampled, joining with the resumed one) change
    # neither the uninterrupted nor the resumed seeded output.
    full = _text(seeded)

    def others() -> list[EngineRequest]:
        return [
            EngineRequest(
                f"o{i}",
                Prompt(messages=[ChatMessage("user", q)]),
                P.text(temperature=0.8 * (i % 2), max_tokens=10 + 7 * i, ignore_eos=True),
                _no_inputs(),
            )
            for i, q in enumerate(OTHERS)
        ]

    async def together(request: EngineRequest) -> str:
        outs = await asyncio.gather(
            *(_collect(engine, r) for r in [*others()[:2], request, *others()[2:]])
        )
        return _text(outs[2])

    async def _collect(eng: LlmEngine, request: EngineRequest) -> list[EngineChunk]:
        return [c async for c in eng.generate(request)]

    assert asyncio.run(together(_request(**SEEDED))) == full
    for cut in _cuts(seeded):
        rest = asyncio.run(together(_resumed_request(seeded, cut, "resumed")))
        assert _text(seeded[:cut]) + rest == full, cut


def test_penalties_count_the_delivered_tokens_on_resume(engine: LlmEngine) -> None:
    # Seed 7 whatever ``seeded`` chose: a resume from text re-tokenizes what was
    # delivered, and this cut is known to re-tokenize as generated.
    params = {**SEEDED, "seed": 7, "frequency_penalty": 1.5, "presence_penalty": 0.5}
    chunks = _run(engine, _request(**params))
    full = _text(chunks)
    cut = len(chunks) // 2
    delivered = _text(chunks[:cut])
    usage = chunks[cut - 1].usage
    assert usage is not None
    prompt = Prompt(messages=[ChatMessage("user", PROMPT)])
    request = EngineRequest(
        "r", prompt, P.text(params), _no_inputs(), delivered, usage.completion_tokens
    )
    assert delivered + _text(_run(engine, request)) == full
