"""The fast CPU thinker (``backend: fast``, 4-bit weights) on the real SmolLM2 weights.

Quantized weights move the logits a little, so these check behaviour, not fp32 text:
right answers, next-token choices that agree with the fp32 transformers model, a batch
that gives every row what it gets alone (rows joining and leaving included), and the
transformers backend still selectable.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch

from omnistage.config.schema import StageConfig
from omnistage.engines.base import EngineChunk, EngineRequest, StageInput
from omnistage.engines.llm import int4_kernel, slot_batch, weights
from omnistage.engines.llm.engine import LlmEngine
from omnistage.engines.llm.fast_llama import FastLlama
from omnistage.engines.llm.slot_batch import SlotBatch
from omnistage.protocol.messages import ChatMessage, Prompt
from tests import int4_kernels
from tests import params as P

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}
QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
)


async def _no_inputs() -> AsyncIterator[StageInput]:
    return
    yield  # pragma: no cover


def _request(text: str, rid: str = "r", **params: Any) -> EngineRequest:
    prompt = Prompt(messages=[ChatMessage("user", text)])
    return EngineRequest(rid, prompt, P.text({**GREEDY, **params}), _no_inputs())


async def _collect(engine: LlmEngine, request: EngineRequest) -> list[EngineChunk]:
    return [c async for c in engine.generate(request)]


def _text(chunks: list[EngineChunk]) -> str:
    return "".join(c.text for c in chunks)


def _engine(**engine_args: Any) -> LlmEngine:
    stage = StageConfig(stage_id=0, name="thinker", engine="llm", engine_args=engine_args)
    return LlmEngine(stage)


@pytest.fixture(scope="module")
def engine() -> Iterator[LlmEngine]:
    eng = _engine()  # the default: fast on a CPU
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.shutdown())


def test_the_default_thinker_on_cpu_is_the_fast_one(engine: LlmEngine) -> None:
    assert engine.backend == "fast"


def test_answers_the_capital_of_france(engine: LlmEngine) -> None:
    chunks = asyncio.run(_collect(engine, _request(QUESTIONS[0], max_tokens=24)))
    assert "Paris" in _text(chunks)
    last = chunks[-1]
    assert last.finished and last.finish_reason == "stop"


def test_rows_joining_and_leaving_get_what_they_get_alone(engine: LlmEngine) -> None:
    # Different lengths: rows leave the batch at different steps (later rows move down
    # into the freed slots) while the others go on.
    lengths = (5, 40, 12, 30, 3, 25, 8, 33)
    requests = [
        (QUESTIONS[i % len(QUESTIONS)], n, {"ignore_eos": True}) for i, n in enumerate(lengths)
    ]
    solo = [
        _text(asyncio.run(_collect(engine, _request(q, max_tokens=n, **kw))))
        for q, n, kw in requests
    ]

    async def together() -> list[list[EngineChunk]]:
        return await asyncio.gather(
            *(
                _collect(engine, _request(q, f"r{i}", max_tokens=n, **kw))
                for i, (q, n, kw) in enumerate(requests)
            )
        )

    assert [_text(c) for c in asyncio.run(together())] == solo


def test_seeded_sampling_repeats(engine: LlmEngine) -> None:
    params = {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_tokens": 30}
    runs = [_text(asyncio.run(_collect(engine, _request(QUESTIONS[3], **params)))) for _ in "ab"]
    assert runs[0] == runs[1] and runs[0]


def test_logprobs_come_from_float32_logits(engine: LlmEngine) -> None:
    chunks = asyncio.run(
        _collect(engine, _request(QUESTIONS[0], max_tokens=8, logprobs=True, top_logprobs=5))
    )
    entries = [e for c in chunks for e in (c.logprobs or [])]
    assert entries
    for entry in entries:
        # Greedy: the chosen token is the best alternative; distinct values, no
        # bfloat16 ties among the best ones.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        values = [alt.logprob for alt in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert len(set(values)) == len(values)


@pytest.fixture(scope="module")
def fp32() -> Any:
    from transformers import AutoModelForCausalLM

    directory = weights.local_model_dir("smollm2")
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.mark.parametrize("kernel", int4_kernels.usable())
def test_next_token_choices_agree_with_the_fp32_model(
    engine: LlmEngine, fp32: Any, kernel: str
) -> None:
    fast = FastLlama(weights.local_model_dir("smollm2"), int4_kernels.load(kernel))
    tokenizer = engine.tokenizer
    agree = total = 0
    for question in QUESTIONS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        with torch.inference_mode():
            expected = fp32(torch.tensor([ids])).logits[0].log_softmax(-1)
            batch = SlotBatch(fast, 1)
            got = batch.prefill(ids).log_softmax(-1)
        # The last position: the first answer token.
        best = int(expected[-1].argmax())
        assert got[best] > expected[-1, best] - 0.5
        # Every prefix: the fp32 model's choice is (nearly always) the fast one's too.
        with torch.inference_mode():
            for n in range(4, len(ids) + 1):
                batch = SlotBatch(fast, 1)
                agree += int(batch.prefill(ids[:n]).argmax()) == int(expected[n - 1].argmax())
                total += 1
    assert agree / total >= 0.9, (agree, total)


@pytest.mark.parametrize("kernel", [k for k in int4_kernels.usable() if k != "avx512-vnni"])
def test_every_int4_kernel_answers_the_capital_of_france(kernel: str) -> None:
    # The module's engine runs the default (ours, the best variant here); the others
    # are what other CPUs get.
    eng = _engine(int4_kernel=kernel)
    asyncio.run(eng.start())
    try:
        # What the replica reports it runs on (Ready.kernel).
        assert eng.kernel == {"torch": "torch", "avx2": "int4-avx2"}[kernel]
        chunks = asyncio.run(_collect(eng, _request(QUESTIONS[0], max_tokens=24)))
        assert "Paris" in _text(chunks)
    finally:
        asyncio.run(eng.shutdown())


def test_without_our_kernel_the_torch_path_answers_alike_and_start_up_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A machine where the install built no library (no C compiler) or whose CPU lacks
    # the instructions: the default engine runs on torch's int4 kernel, answering as
    # one told to, and says so once as a WARNING naming why.
    monkeypatch.setattr(int4_kernel, "load", lambda: "_int4_kernel is not built")
    answers = []
    for args in ({}, {"int4_kernel": "torch"}):
        eng = _engine(**args)
        with caplog.at_level(logging.WARNING):
            asyncio.run(eng.start())
        try:
            assert eng.kernel == "torch"
            chunks = asyncio.run(_collect(eng, _request(QUESTIONS[0], max_tokens=24)))
            answers.append(_text(chunks))
        finally:
            asyncio.run(eng.shutdown())
    assert answers[0] == answers[1] and "Paris" in answers[0]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([w for w in warned if "torch's kernel" in w]) == 1
    assert any("_int4_kernel is not built" in w for w in warned)


def test_the_transformers_backend_is_still_selectable() -> None:
    eng = _engine(backend="transformers")
    asyncio.run(eng.start())
    try:
        assert eng.backend == "transformers"
        chunks = asyncio.run(_collect(eng, _request(QUESTIONS[0], max_tokens=24)))
        assert "Paris" in _text(chunks)
    finally:
        asyncio.run(eng.shutdown())


def _chat_ids(engine: LlmEngine, messages: list[dict[str, str]]) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_a_cached_prefix_gives_the_same_bits_as_computing_it(engine: LlmEngine) -> None:
    fast = FastLlama(weights.local_model_dir("smollm2"))
    turn_ends = frozenset(engine._eos_ids)
    first = [{"role": "user", "content": QUESTIONS[0]}]
    # A conversation's next turn: the whole first exchange is its prefix.
    second = [
        *first,
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And what is its most famous tower called?"},
    ]
    prompts = [_chat_ids(engine, m) for m in (first, second)]
    prompts.append(_chat_ids(engine, [{"role": "user", "content": QUESTIONS[1]}]))
    with torch.inference_mode():
        alone = [SlotBatch(fast, 1, turn_ends, 0).prefill(ids) for ids in prompts]
        shared = SlotBatch(fast, 4, turn_ends, 4096)
        together = []
        for ids in prompts:
            together.append(shared.prefill(ids))
            shared.admit(int(together[-1].argmax()))
    # The later prompts took at least the system turn (~20 tokens) from the cache.
    assert shared.prefixes.hit_tokens >= 2 * 16
    for got, want in zip(together, alone, strict=True):
        assert torch.equal(got, want)


def _run_rows(batch: SlotBatch, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Prefill and admit each prompt, then ``steps`` greedy decode steps: every logits."""
    out = []
    for ids in prompts:
        out.append(batch.prefill(ids))
        batch.admit(int(out[-1].argmax()))
    for _ in range(steps):
        logits = batch.decode()
        out.append(logits)
        batch.advance([int(row.argmax()) for row in logits])
    return out


@pytest.mark.parametrize("kernel", ["torch", "avx512-vnni", "avx2"])
def test_an_emptied_batch_keeps_its_cache_and_rows_get_the_same_bits(
    engine: LlmEngine, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The decode step's attention on our kernels reads each row's own positions; torch's
    # reads the whole length under a mask: stale K/V from earlier rows must count in neither.
    if kernel != "torch" and isinstance(int4_kernel.load_variant(kernel), str):
        pytest.skip(f"{kernel} does not run here")
    fast = FastLlama(weights.local_model_dir("smollm2"), int4_kernels.load(kernel))
    earlier = [_chat_ids(engine, [{"role": "user", "content": q}]) for q in QUESTIONS]
    later = [_chat_ids(engine, [{"role": "user", "content": q}]) for q in QUESTIONS[2:0:-1]]
    with torch.inference_mode():
        used = SlotBatch(fast, 4)
        _run_rows(used, earlier, 6)
        caches = [t.data_ptr() for t in used._keys]
        used.keep([])
        assert used.rows == 0 and [t.data_ptr() for t in used._keys] == caches
        again = _run_rows(used, later, 5)
        fresh = _run_rows(SlotBatch(fast, 4), later, 5)
        assert all(torch.equal(a, b) for a, b in zip(again, fresh, strict=True))
        # Above the budget an emptied batch lets its cache go.
        monkeypatch.setattr(slot_batch, "KEEP_BYTES", 0)
        used.keep([])
        assert used.cache_bytes() == 0


@pytest.mark.parametrize("kernel", [k for k in int4_kernels.usable() if k != "torch"])
def test_prefilled_tokens_give_the_bits_their_decode_steps_gave(
    engine: LlmEngine, kernel: str
) -> None:
    # What a retry does with the tokens a failed replica delivered: prefill them after
    # the prompt. On our kernels (a short chunk attends row by row) that is the same
    # arithmetic as decoding them one at a time, beside other rows or alone, so the
    # next token's logits are the same bits and a seeded draw cannot drift. Torch's
    # attention promises no such thing (its prefill rounds differently: ~1e-3 here).
    fast = FastLlama(weights.local_model_dir("smollm2"), int4_kernels.load(kernel))
    prompt = _chat_ids(engine, [{"role": "user", "content": QUESTIONS[3]}])
    other = _chat_ids(engine, [{"role": "user", "content": QUESTIONS[0]}])
    with torch.inference_mode():
        decoded = SlotBatch(fast, 2)
        decoded.admit(int(decoded.prefill(other).argmax()))
        tokens = [int(decoded.prefill(prompt).argmax())]
        decoded.admit(tokens[0])
        for _ in range(12):  # two rows decoding, the other one's first
            logits = decoded.decode()
            decoded.advance([int(row.argmax()) for row in logits])
            tokens.append(int(logits[1].argmax()))
        # The last step's logits followed every token but the one they chose.
        resumed = SlotBatch(fast, 1).prefill([*prompt, *tokens[:-1]])
    assert torch.equal(resumed, logits[1])


def test_a_row_growing_past_the_capacity_keeps_the_slots_the_rows_need(engine: LlmEngine) -> None:
    # A conversation grows one row past a capacity chunk per ~256 tokens: the cache
    # must grow in positions only, not copy itself into more slots each time.
    fast = FastLlama(weights.local_model_dir("smollm2"))
    short = _chat_ids(engine, [{"role": "user", "content": QUESTIONS[0]}])
    long = _chat_ids(engine, [{"role": "user", "content": " ".join(QUESTIONS * 12)}])
    assert slot_batch._CHUNK < len(long) < 2 * slot_batch._CHUNK
    with torch.inference_mode():
        batch = SlotBatch(fast, 8)
        batch.prefill(short)
        batch.admit(0)
        batch.keep([])
        batch.prefill(long)
        assert batch._keys[0].shape[0] == 1  # slots
        assert batch._keys[0].shape[2] == 2 * slot_batch._CHUNK  # positions
        batch.admit(0)
        batch.prefill(short)  # a second row: now two slots
        batch.admit(0)
        assert batch._keys[0].shape[0] == 2


def test_the_step_loop_runs_on_the_thread_that_loaded_the_model() -> None:
    import threading

    eng = _engine()
    asyncio.run(eng.start())
    try:
        assert eng._torch is not None
        batch = eng._worker._batch  # type: ignore[union-attr]
        decode_threads: set[int] = set()
        real_decode = batch.decode

        def decode() -> torch.Tensor:
            decode_threads.add(threading.get_ident())
            return real_decode()

        batch.decode = decode
        assert _text(asyncio.run(_collect(eng, _request(QUESTIONS[2], max_tokens=6))))
        # One OpenMP pool in the process (see torch_threads.TorchThread).
        assert decode_threads == {eng._torch.ident}
    finally:
        asyncio.run(eng.shutdown())
