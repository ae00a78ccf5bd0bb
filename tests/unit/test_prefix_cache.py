"""Where prompts are cut for prefill, and the cache of finished turns' KV."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from omnistage.engines.llm.prefix_cache import MIN_LAST_CHUNK, PrefixCache, cuts  # noqa: E402

END = 2  # an end-of-turn token


def test_prompts_are_cut_after_each_turn_end_leaving_a_long_enough_last_chunk() -> None:
    system = [1, 5, 6, 7, END, 9]
    user = [1, *range(10, 10 + MIN_LAST_CHUNK), END, 9]
    header = [1, 8, 9]
    ids = system + user + header
    # After the system turn; the user turn's end leaves too short a last chunk.
    assert cuts(ids, frozenset({END})) == [len(system) - 1]
    # A longer tail keeps that cut too.
    longer = ids + list(range(100, 100 + MIN_LAST_CHUNK))
    assert cuts(longer, frozenset({END})) == [len(system) - 1, len(system + user) - 1]
    assert cuts(ids, frozenset()) == []
    assert cuts([END] * 3, frozenset({END})) == []  # too short to cut at all


def _caches(slots: int = 2, capacity: int = 32) -> tuple[list, list]:
    keys = [torch.zeros(slots, 1, capacity, 2) for _ in range(2)]
    values = [torch.zeros(slots, 1, capacity, 2) for _ in range(2)]
    return keys, values


def _fill(keys: list, values: list, slot: int, n: int, base: float) -> None:
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        k[slot, :, :n] = base + layer + torch.arange(n).view(1, n, 1).float()
        v[slot, :, :n] = -(base + layer)


def test_a_stored_prefix_is_restored_into_another_slot_and_the_longest_wins() -> None:
    cache = PrefixCache(budget_tokens=100)
    keys, values = _caches()
    ids = list(range(20))
    _fill(keys, values, slot=0, n=12, base=1.0)
    cache.store(ids[:5], 0, keys, values)
    cache.store(ids[:12], 0, keys, values)
    assert cache.tokens == 17
    got = cache.restore(ids, [5, 12], 1, keys, values)
    assert got == 12 and cache.hit_tokens == 12
    for k, v in zip(keys, values, strict=True):
        assert torch.equal(k[1, :, :12], k[0, :, :12])
        assert torch.equal(v[1, :, :12], v[0, :, :12])
    # Another prompt sharing only the first 5 tokens gets those.
    other = ids[:5] + [99] * 10
    assert cache.restore(other, [5, 12], 1, keys, values) == 5
    assert cache.restore([7] * 20, [5, 12], 1, keys, values) == 0


@pytest.mark.parametrize("answers", [True, False])
def test_a_kept_answer_is_found_one_short_of_the_cut_after_it(answers: bool) -> None:
    cache = PrefixCache(budget_tokens=100, answers=answers)
    keys, values = _caches()
    system, question, answer = [1, 5, END], [1, 6, 7, END], [1, 8, 9, 10]
    _fill(keys, values, slot=0, n=16, base=3.0)
    cache.store(system, 0, keys, values)
    # The row held the prompt and the answer's tokens, not the end of turn after them.
    cache.store(system + question + answer, 0, keys, values, label=42)
    nxt = system + question + answer + [END] + [1, 11, 12, 13, 14, END, 1, 12]
    at = cuts(nxt, frozenset({END}))
    assert at == [3, 7, 12]
    got = cache.restore(nxt, at, 1, keys, values, labels={12: 43})
    if answers:
        assert got == 11 and cache.hit_tokens == 11
        assert torch.equal(keys[0][1, :, :11], keys[0][0, :, :11])
        # The entry takes the key the prompt gives the messages ending at that cut.
        assert cache._labels[tuple(nxt[:11])] == [43, 42]
    else:
        assert got == 3  # only whole turns count


def test_the_budget_evicts_the_least_recently_used() -> None:
    cache = PrefixCache(budget_tokens=10)
    keys, values = _caches()
    _fill(keys, values, 0, 8, 0.0)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]
    cache.store(a, 0, keys, values)
    cache.store(b, 0, keys, values)
    assert cache.restore([*a, 0], [4], 1, keys, values) == 4  # a is now the most recent
    cache.store(c, 0, keys, values)  # 11 > 10: b goes
    assert cache.tokens == 7
    assert cache.restore([*b, 0], [4], 1, keys, values) == 0
    assert cache.restore([*a, 0], [4], 1, keys, values) == 4
    cache.store(list(range(11)), 0, keys, values)  # larger than the budget: not kept
    assert cache.tokens == 7


def test_a_zero_budget_keeps_nothing() -> None:
    cache = PrefixCache(budget_tokens=0)
    keys, values = _caches()
    cache.store([1, 2, 3], 0, keys, values)
    assert cache.tokens == 0 and cache.restore([1, 2, 3, 4], [3], 1, keys, values) == 0


def test_the_published_keys_follow_stores_hits_evictions_and_clear() -> None:
    cache = PrefixCache(budget_tokens=10)
    keys, values = _caches()
    _fill(keys, values, 0, 8, 0.0)
    assert cache.published == (0, ())
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]
    cache.store(a, 0, keys, values, label=100)
    cache.store(b, 0, keys, values, label=200)
    v1, held = cache.published
    assert held == (200, 100)  # most recently used first
    cache.store(b, 0, keys, values, label=200)  # already held: nothing changes
    assert cache.published == (v1, held)
    assert cache.restore([*a, 0], [4], 1, keys, values, {4: 100}) == 4
    v2, held = cache.published
    assert held == (100, 200) and v2 > v1  # a hit makes it the most recent
    cache.store(c, 0, keys, values)  # unlabelled (a text prompt); b is evicted
    v3, held = cache.published
    assert held == (100,) and v3 > v2
    cache.clear()
    v4, held = cache.published
    assert held == () and v4 > v3


def test_the_same_tokens_can_hold_several_keys() -> None:
    # A client's system message that reads as the stage's system prompt: same tokens,
    # other messages, so another key for the same entry.
    cache = PrefixCache(budget_tokens=100)
    keys, values = _caches()
    _fill(keys, values, 0, 8, 0.0)
    cache.store([1, 2, 3], 0, keys, values, label=7)
    cache.store([1, 2, 3], 0, keys, values, label=8)
    assert cache.published[1] == (8, 7)
    assert cache.restore([1, 2, 3, 4], [3], 1, keys, values, {3: 7}) == 3
    assert cache.published[1] == (7, 8)
    for label in range(100):  # a bounded number per entry
        cache.store([1, 2, 3], 0, keys, values, label=label)
    assert len(cache.published[1]) <= 64


def test_at_most_max_reported_keys_are_published(monkeypatch: pytest.MonkeyPatch) -> None:
    from omnistage.engines.llm import prefix_cache

    monkeypatch.setattr(prefix_cache, "MAX_REPORTED", 3)
    cache = PrefixCache(budget_tokens=100)
    keys, values = _caches()
    for i in range(5):
        cache.store([50 + i], 0, keys, values, label=i)
    assert cache.published[1] == (4, 3, 2)


def test_a_conversation_holds_one_entry_that_serves_its_earlier_prefixes() -> None:
    cache = PrefixCache(budget_tokens=100, answers=True, turn_ends=frozenset({END}))
    keys, values = _caches()
    _fill(keys, values, slot=0, n=30, base=5.0)
    system, q1, a1, q2, a2 = [1, 5, END], [1, 6, END], [1, 7, 8], [1, 9, END], [1, 3, 4]
    cache.store(system, 0, keys, values)  # a first turn's prefill
    cache.store(system + q1 + a1, 0, keys, values, label=1)  # its answer
    assert len(cache._entries) == 1 and cache.tokens == 9  # the system turn is inside
    # The next turn's answer takes the first's entry over, and its key.
    turn2 = system + q1 + a1 + [END] + q2 + a2
    cache.store(turn2, 0, keys, values, label=2)
    assert list(cache._entries) == [tuple(turn2)] and cache.tokens == len(turn2)
    assert cache.published[1] == (2, 1)
    # Every earlier prefix at a turn's end is still served, from the one entry.
    for prefix in (system, system + q1, system + q1 + a1 + [END]):
        ids = [*prefix, 60, 61]
        slot_keys, slot_values = _caches()
        assert cache.restore(ids, [len(prefix)], 1, slot_keys, slot_values) == len(prefix)
        assert torch.equal(slot_keys[1][1, :, : len(prefix)], keys[1][0, :, : len(prefix)])
    # Storing a prefix it holds adds nothing; another conversation adds its own entry,
    # sharing nothing but the system turn (served by whichever entry has it).
    cache.store(system + q1, 0, keys, values)
    assert cache.tokens == len(turn2)
    other = [*system, 1, 40, END, 1, 41, 42]
    cache.store(other, 0, keys, values, label=3)
    assert len(cache._entries) == 2 and cache.tokens == len(turn2) + len(other)
    # Evicting the conversation's entry drops its prefixes but not the other's.
    cache.store(list(range(200, 200 + 100 - len(other))), 0, keys, values)
    assert tuple(turn2) not in cache._entries
    assert cache.restore([*system + q1, 9], [3, 6], 1, keys, values) == 3  # from the other
    assert cache.published[1] == (3,)


def test_an_answer_cut_by_max_tokens_is_found_two_short_of_the_cut_after_it() -> None:
    cache = PrefixCache(budget_tokens=100, answers=True, turn_ends=frozenset({END}))
    keys, values = _caches()
    _fill(keys, values, slot=0, n=16, base=3.0)
    prompt, answer = [1, 5, END, 1, 6, END, 1], [7, 8, 9]
    # The row held the prompt and the answer but its last token.
    cache.store(prompt + answer[:-1], 0, keys, values, label=5)
    nxt = prompt + answer + [END] + [1, 11, 12, 13, 14, 15, END, 1, 12]
    at = cuts(nxt, frozenset({END}))
    assert cache.restore(nxt, at, 1, keys, values) == len(prompt) + 2
