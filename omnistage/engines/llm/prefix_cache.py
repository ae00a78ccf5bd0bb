"""Prompts prefilled turn by turn, and the KV of finished turns kept for the next prompt.

Chat prompts repeat their beginnings: every request of a pipeline starts with the same
system turn (SmolLM2's template adds one: 20 of a short question's ~40 tokens), and a
conversation's next request starts with the whole previous one. Prefill is compute bound
on the CPU, so not computing a prefix again is the cheapest prefill there is.

It has to be exact. The numbers a forward gives for a token depend on how many tokens
were computed with it (the int4 kernel and attention block their work by row count), so
a prefix's KV taken from another request must have been computed exactly as this request
would have computed it. Hence the cut: a prompt is always prefilled in chunks that end
after each end-of-turn token (``cuts``), whether or not anything is cached, so a chunk's
numbers depend only on the tokens up to its end, and a cached prefix is the same bits as
a computed one. A request's answer is then the same whatever ran before it (the batch
invariance exact resume relies on).

Answers are kept too (``cache_answers``), and that part is not exact. A conversation's
next prompt holds the previous answer, whose KV the decode steps computed one token at a
time: a later prompt that finds the answer's entry computes the rest over those bits,
and a replica without it prefills the answer, rounding differently. So with answers
kept, a later turn's answer may differ from the one a cold replica gives (a near-tie at
temperature 0). It pays where it matters: the answer is most of what a conversation's
next prompt adds, and without it every turn prefills the previous answer again. An
answer's entry holds the prompt and the answer's tokens but not what was never fed back
(the end-of-turn token that closed it; for an answer max_tokens cut, its last token), so
it is found up to ``ANSWER_GAP`` positions before a cut.

Each entry carries the prefix keys (``protocol/prefix``) of the chat messages it holds,
when the engine knows them (``prefix_labels``); the cache publishes the keys it holds,
most recently used first, as one ``(version, keys)`` tuple that the heartbeat thread
reads while the step loop goes on (one attribute, swapped whole: never torn).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch

from omnistage.protocol.prefix import MAX_REPORTED

# The last chunk of a prompt is at least this long (unless it is the whole prompt): a
# forward has a fixed cost (~750 small ops), and the few tokens after the last turn (the
# assistant's header) are cheaper in the chunk before them. Dropping a cut for this
# depends on the tokens after it, but only a cut that is kept is ever cached, and every
# cut before a kept one is kept too, so the chunks of a cached prefix are the same in
# every prompt that has it.
MIN_LAST_CHUNK = 8
# How far before a cut a kept answer's entry may end: 1 (its end-of-turn token's KV is
# never computed) or 2 (max_tokens cut it: its last token was sampled, never fed back).
ANSWER_GAP = 2
# Keys kept per entry: an entry holds each message prefix of a conversation, and the
# same tokens can hold different messages (a client's system message that reads as the
# stage's own system prompt), each with its key.
_MAX_LABELS = 64


def cuts(ids: Sequence[int], turn_ends: frozenset[int]) -> list[int]:
    """Where the prefill of ``ids`` is cut: after every end-of-turn token, leaving at
    least ``MIN_LAST_CHUNK`` tokens after the last cut."""
    last = len(ids) - MIN_LAST_CHUNK
    return [i + 1 for i, token in enumerate(ids[:last]) if token in turn_ends]


class PrefixCache:
    """KV of prompt prefixes that end at a cut (and of answers), least recently used
    out first, at most ``budget_tokens`` positions in all (0: nothing kept).

    An entry also serves every shorter prefix of it that ends at a turn's end: a
    conversation's entries would otherwise each repeat the one before (turn t's holds
    all of turn t - 1's), so a new entry takes over the entries it extends, and the
    positions a conversation holds grow with its length, not with its square.
    ``turn_ends``: the end-of-turn tokens (none: each entry serves its own key only).
    """

    def __init__(
        self, budget_tokens: int, answers: bool = False, turn_ends: frozenset[int] = frozenset()
    ) -> None:
        self.budget_tokens = budget_tokens
        # Restore from answers' entries too (``remember``), one position before a cut.
        self.answers = answers
        self._turn_ends = turn_ends
        self._entries: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]]
        self._entries = OrderedDict()
        # A prefix (at a turn's end, or a whole entry) -> the entry that holds it.
        self._covers: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.tokens = 0  # positions held
        self.hit_tokens = 0  # prefill positions not computed thanks to the cache
        self._labels: dict[tuple[int, ...], list[int]] = {}  # entry -> its keys, newest first
        # The keys held, most recently used first, and a version that changes with them.
        self.published: tuple[int, tuple[int, ...]] = (0, ())

    def restore(
        self,
        ids: Sequence[int],
        at: Sequence[int],
        slot: int,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        labels: Mapping[int, int] | None = None,
    ) -> int:
        """Copy the longest cached prefix of ``ids`` that ends at one of the cuts ``at``
        (or, for a kept answer, up to ``ANSWER_GAP`` positions before it) into ``slot``
        of the per-layer caches; its length (0: none). ``labels``: prefix end -> the key
        of the messages it holds in this prompt."""
        gap = ANSWER_GAP if self.answers else 0
        for cut in reversed(at):
            for end in range(cut, cut - gap - 1, -1):
                owner = self._covers.get(tuple(ids[:end]))
                if owner is not None:
                    label = (labels or {}).get(cut)
                    return self._restore(owner, end, slot, keys, values, label)
        return 0

    def _restore(
        self,
        owner: tuple[int, ...],
        end: int,
        slot: int,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        label: int | None,
    ) -> int:
        entry = self._entries[owner]
        self._entries.move_to_end(owner)
        self._label(owner, label)
        for (k, v), layer_k, layer_v in zip(entry, keys, values, strict=True):
            layer_k[slot, :, :end] = k[:, :end]
            layer_v[slot, :, :end] = v[:, :end]
        self.hit_tokens += end
        self._publish()
        return end

    def store(
        self,
        prefix: Sequence[int],
        slot: int,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        label: int | None = None,
    ) -> None:
        """Keep the KV of ``prefix``, which ``slot`` holds from position 0; ``label``:
        the key of the messages it holds, if known."""
        end = len(prefix)
        key = tuple(prefix)
        owner = self._covers.get(key)
        if owner is not None:  # held already, by its own entry or a longer one
            self._entries.move_to_end(owner)
            if self._label(owner, label):
                self._publish()
            return
        if end > self.budget_tokens:
            return
        ends = self._ends(key)
        # The entries this one extends: it holds all they do (a conversation's last
        # turn, the answer before it), so their keys and prefixes move to it.
        taken: list[int] = []
        for e in ends[:-1]:
            for shorter in (key[: e - back] for back in range(ANSWER_GAP + 1)):
                if shorter in self._entries:
                    taken.extend(self._drop(shorter))
        while self._entries and self.tokens + end > self.budget_tokens:
            old = next(iter(self._entries))
            self._drop(old)
        self._entries[key] = [
            (k[slot, :, :end].clone(), v[slot, :, :end].clone())
            for k, v in zip(keys, values, strict=True)
        ]
        self.tokens += end
        for e in ends:  # the newest holder: a hit keeps it the most recently used
            self._covers[key[:e]] = key
        for old_label in reversed(taken):
            self._label(key, old_label)
        self._label(key, label)
        self._publish()

    def _ends(self, key: tuple[int, ...]) -> list[int]:
        """The prefix lengths an entry for ``key`` serves: after each end of turn in it,
        and the whole."""
        ends = [i + 1 for i, token in enumerate(key[:-1]) if token in self._turn_ends]
        return [*ends, len(key)]

    def _drop(self, key: tuple[int, ...]) -> list[int]:
        """Remove entry ``key``; its labels (newest first)."""
        del self._entries[key]
        self.tokens -= len(key)
        for e in self._ends(key):
            prefix = key[:e]
            if self._covers.get(prefix) == key:
                # Another entry may hold it too (every conversation has the system turn).
                heir = next((k for k in reversed(self._entries) if self._holds(k, prefix)), None)
                if heir is None:
                    del self._covers[prefix]
                else:
                    self._covers[prefix] = heir
        return self._labels.pop(key, [])

    def _holds(self, key: tuple[int, ...], prefix: tuple[int, ...]) -> bool:
        """Whether entry ``key`` serves ``prefix``."""
        n = len(prefix)
        if n > len(key) or key[:n] != prefix:
            return False
        return n == len(key) or key[n - 1] in self._turn_ends

    def clear(self) -> None:
        self._entries.clear()
        self._covers.clear()
        self._labels.clear()
        self.tokens = 0
        self._publish()

    def _label(self, key: tuple[int, ...], label: int | None) -> bool:
        """Give entry ``key`` the key ``label`` (newest first); True if it was new."""
        if label is None:
            return False
        labels = self._labels.setdefault(key, [])
        if labels and labels[0] == label:
            return False
        if label in labels:
            labels.remove(label)
        labels.insert(0, label)
        del labels[_MAX_LABELS:]
        return True

    def _publish(self) -> None:
        """Swap in the keys held, most recently used first, if they changed. Runs on the
        step loop's thread, the only one that changes the cache."""
        held: dict[int, None] = {}
        for key in reversed(self._entries):
            for label in self._labels.get(key, ()):
                held.setdefault(label)
            if len(held) >= MAX_REPORTED:
                break
        keys = tuple(held)[:MAX_REPORTED]
        version, before = self.published
        if keys != before:
            self.published = (version + 1, keys)
