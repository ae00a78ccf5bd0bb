"""Incremental detokenization: whole characters only, stop strings never leak."""

from __future__ import annotations

from omnistage.engines.llm.detok import Detokenizer


class ByteTokenizer:
    """Each token id is one UTF-8 byte: multi-byte characters span several tokens."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def feed(detok: Detokenizer, text: str) -> list[str]:
    return [detok.add(b) for b in text.encode()]


def test_multibyte_characters_are_released_whole() -> None:
    detok = Detokenizer(ByteTokenizer())
    deltas = feed(detok, "café ☕ ok")
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.finish() == "café ☕ ok"
    # The three bytes of the cup arrive as one delta, not as pieces.
    assert "☕" in deltas


def test_stop_string_is_cut_and_never_released() -> None:
    detok = Detokenizer(ByteTokenizer(), stop=("END",))
    out = "".join(feed(detok, "hello ENDING more"))
    out += detok.finish()
    assert out == "hello "
    assert detok.stopped


def test_text_that_only_looks_like_a_stop_prefix_is_released_at_the_end() -> None:
    detok = Detokenizer(ByteTokenizer(), stop=("STOP",))
    deltas = feed(detok, "a STO")
    assert "".join(deltas) == "a "  # "STO" held back: it may become "STOP"
    assert detok.finish() == "STO"
    assert not detok.stopped


def test_stop_split_across_tokens_is_found() -> None:
    detok = Detokenizer(ByteTokenizer(), stop=("\n\n",))
    out = "".join(feed(detok, "line one\n\nline two")) + detok.finish()
    assert out == "line one"
