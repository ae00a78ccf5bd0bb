"""Sampling parameters and the sampler (needs torch, as the llm engine does)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from omnistage.engines.llm.sampling import Sampler, SamplingParams  # noqa: E402
from omnistage.protocol.errors import BadRequestError  # noqa: E402
from omnistage.protocol.params import ParamKind, decode  # noqa: E402


def _params(raw: dict, default_max_tokens: int) -> SamplingParams:
    """Request params as the API decodes them, then as the engine reads them."""
    return SamplingParams.from_params(decode(ParamKind.TEXT, raw).generation, default_max_tokens)


def test_params_take_defaults_and_normalize_stop() -> None:
    p = _params({"stop": "x", "temperature": 0}, default_max_tokens=50)
    assert p.stop == ("x",) and p.greedy and p.max_tokens == 50


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"seed": "7"}, "seed"),
        ({"top_k": -5}, "top_k"),
    ],
)
def test_bad_params_are_bad_requests_naming_the_field(params: dict, param: str) -> None:
    with pytest.raises(BadRequestError) as info:
        _params(params, 16)
    assert info.value.param == param


def test_greedy_picks_the_argmax() -> None:
    s = Sampler(SamplingParams(temperature=0), 5, torch.device("cpu"))
    assert s.sample(torch.tensor([0.1, 3.0, 0.2, -1.0, 2.9])) == 1


def test_same_seed_same_tokens_and_top_k_limits_the_choice() -> None:
    logits = torch.tensor([1.0, 1.1, 0.9, 1.05, 0.95, 1.0])
    params = SamplingParams(temperature=1.0, seed=1234, top_k=2)
    a = Sampler(params, 6, torch.device("cpu"))
    b = Sampler(params, 6, torch.device("cpu"))
    draws_a = [a.sample(logits) for _ in range(50)]
    draws_b = [b.sample(logits) for _ in range(50)]
    assert draws_a == draws_b
    assert set(draws_a) <= {1, 3}  # the two largest logits


def test_top_p_keeps_only_the_smallest_covering_set() -> None:
    logits = torch.log(torch.tensor([0.7, 0.2, 0.05, 0.05]))
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.6, seed=0), 4, torch.device("cpu"))
    assert {s.sample(logits) for _ in range(40)} == {0}


def test_frequency_penalty_discourages_repeats() -> None:
    logits = torch.tensor([2.0, 1.9])
    s = Sampler(SamplingParams(temperature=0, frequency_penalty=1.0), 2, torch.device("cpu"))
    assert [s.sample(logits) for _ in range(3)] == [0, 1, 0]


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_the_nucleus_from_the_top_candidates_draws_as_a_whole_vocabulary_sort(
    top_p: float,
) -> None:
    from omnistage.engines.llm.sampling import NUCLEUS_CANDIDATES, _draw, nucleus, nucleus_full

    gen = torch.Generator().manual_seed(7)
    fallbacks = 0
    for case in range(40):
        # Peaked to flat; bfloat16 logits as the fast thinker gives them (many ties).
        spread = (0.5, 2.0, 6.0, 12.0)[case % 4]
        logits = (torch.randn(49152, generator=gen) * spread).to(torch.bfloat16).float()
        probs = torch.softmax(logits / 0.7, dim=-1)
        fast, fast_order = nucleus(probs, top_p)
        full, full_order = nucleus_full(probs, top_p)
        fallbacks += fast.shape[0] != NUCLEUS_CANDIDATES
        kept = int((full > 0).sum())
        assert torch.equal(fast[:kept], full[:kept])
        assert torch.equal(fast_order[:kept], full_order[:kept])
        assert not fast[kept:].any()
        for u in (0.0, 0.1, 0.37, 0.5, 0.81, 0.999999):
            assert int(fast_order[_draw(fast, u)]) == int(full_order[_draw(full, u)])
    # Both paths ran: peaked rows from the candidates, flat ones by the full sort.
    assert 0 < fallbacks < 40


def test_repetition_penalty_divides_the_logits_of_seen_tokens() -> None:
    # Token 0 is in the prompt: 2.0 / 2 = 1.0 falls below token 1's 1.5; a negative
    # logit is multiplied (-0.5 * 2 = -1.0 below token 3's -0.8).
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    s = Sampler(params, 4, torch.device("cpu"))
    s.read([0])
    assert s.sample(torch.tensor([2.0, 1.5, -5.0, -5.0])) == 1
    # The token it chose counts as seen from then on.
    assert s.sample(torch.tensor([-5.0, 1.9, 1.0, -5.0])) == 2
    neg = Sampler(params, 4, torch.device("cpu"))
    neg.read([2])
    assert neg.sample(torch.tensor([-9.0, -9.0, -0.5, -0.8])) == 3


def test_repetition_penalty_off_ignores_the_prompt() -> None:
    s = Sampler(SamplingParams(temperature=0), 3, torch.device("cpu"))
    s.read([0])
    assert s.sample(torch.tensor([2.0, 1.5, 0.0])) == 0


def test_repetition_penalty_is_read_and_checked() -> None:
    assert _params({"repetition_penalty": 1.2}, 8).repetition_penalty == 1.2
    assert _params({}, 8).repetition_penalty == 1.0
    with pytest.raises(BadRequestError) as info:
        _params({"repetition_penalty": 0}, 8)
    assert info.value.param == "repetition_penalty"
