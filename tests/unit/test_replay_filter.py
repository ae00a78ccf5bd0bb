"""What a replica sends on a retry: ReplayFilter drops what the client already has, and
OutputCoalescer.start_at continues the failed replica's sequence numbers."""

from __future__ import annotations

from omnistage.protocol.messages import OutputChunk
from omnistage.replica.outputs import OutputCoalescer, ReplayFilter


def replay(f: ReplayFilter, pieces: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    return [f.apply(text, data) for text, data in pieces]


def chunk(rid: str, text: str = "", **kw: object) -> OutputChunk:
    return OutputChunk(
        request_id=rid,
        stage_id=0,
        replica_id=1,
        epoch=1,
        seq=-1,
        modality="text",
        text=text,
        **kw,  # type: ignore[arg-type]
    )


# -- ReplayFilter ------------------------------------------------------------------------


def test_text_is_cut_across_chunk_boundaries() -> None:
    # The failed replica delivered "Hello, w" (8 characters); the re-run chunks its
    # output differently, so the cut falls inside the second chunk.
    f = ReplayFilter(text_chars=8, data_chunks=0)
    out = replay(f, [("Hel", b""), ("lo, wor", b""), ("ld", b""), ("!", b"")])
    assert [t for t, _ in out] == ["", "or", "ld", "!"]
    assert "".join(t for t, _ in out) == "Hello, world!"[8:]
    assert f.text_left == 0


def test_a_cut_exactly_on_a_chunk_boundary_keeps_the_next_chunk_whole() -> None:
    f = ReplayFilter(text_chars=5, data_chunks=0)
    assert replay(f, [("Hello", b""), (" there", b"")]) == [("", b""), (" there", b"")]


def test_text_longer_than_the_rerun_output_drops_everything() -> None:
    # Nothing new: every character was already delivered (the engine produced the
    # same text again and finished).
    f = ReplayFilter(text_chars=10, data_chunks=0)
    assert replay(f, [("abc", b""), ("def", b"")]) == [("", b""), ("", b"")]
    assert f.text_left == 4


def test_the_first_data_chunks_are_dropped_whole_and_later_ones_kept() -> None:
    f = ReplayFilter(text_chars=0, data_chunks=2)
    out = replay(f, [("", b"RIFF0"), ("", b"RIFF1"), ("", b"RIFF2"), ("", b"RIFF3")])
    assert out == [("", b""), ("", b""), ("", b"RIFF2"), ("", b"RIFF3")]
    assert f.data_left == 0


def test_text_only_chunks_do_not_use_up_the_data_count_and_vice_versa() -> None:
    f = ReplayFilter(text_chars=2, data_chunks=1)
    out = replay(f, [("", b"A"), ("xyz", b""), ("", b"B")])
    # The data chunk counts only against data, the text chunk only against text.
    assert out == [("", b""), ("z", b""), ("", b"B")]


def test_a_chunk_with_text_and_data_is_counted_against_both() -> None:
    # E.g. a TTS chunk carrying a sentence and its audio: the head counted it as one
    # data chunk and its text as delivered text, so the re-run's copy drops both.
    f = ReplayFilter(text_chars=len("Hi there. "), data_chunks=1)
    out = replay(f, [("Hi there. ", b"wav1"), ("Bye.", b"wav2")])
    assert out == [("", b""), ("Bye.", b"wav2")]


def test_a_chunk_with_text_and_data_past_the_text_cut_keeps_its_data_if_not_delivered() -> None:
    f = ReplayFilter(text_chars=3, data_chunks=0)
    assert f.apply("abcdef", b"wav") == ("def", b"wav")


def test_nothing_is_dropped_when_nothing_was_delivered() -> None:
    f = ReplayFilter(text_chars=0, data_chunks=0)
    pieces = [("a", b""), ("", b"X"), ("bc", b"Y"), ("", b"")]
    assert replay(f, pieces) == pieces


def test_empty_chunks_leave_the_counts_alone() -> None:
    f = ReplayFilter(text_chars=2, data_chunks=1)
    assert f.apply("", b"") == ("", b"")
    assert (f.text_left, f.data_left) == (2, 1)


def test_text_is_cut_by_characters_not_bytes() -> None:
    # The head counts delivered text in str characters; multi-byte characters must
    # not shift the cut.
    f = ReplayFilter(text_chars=len("café "), data_chunks=0)
    out = replay(f, [("ca", b""), ("fé 😀", b""), (" fin", b"")])
    assert "".join(t for t, _ in out) == "😀 fin"


# -- OutputCoalescer.start_at / forget -----------------------------------------------------


def test_start_at_continues_the_sequence_of_a_retried_request() -> None:
    c = OutputCoalescer()
    c.start_at("r", 7)
    c.add(chunk("r", "a"))
    assert [o.seq for o in c.drain()] == [7]
    c.add(chunk("r", "b"))
    assert [o.seq for o in c.drain()] == [8]


def test_start_at_with_merged_text_numbers_the_merged_chunk_once() -> None:
    c = OutputCoalescer()
    c.start_at("r", 3)
    c.add(chunk("r", "hel"))
    c.add(chunk("r", "lo"))
    c.add(OutputChunk("r", 0, 1, 1, -1, "audio", data=b"wav"))  # never merged
    c.add(chunk("r", "!", finished=True, finish_reason="stop"))
    out = c.drain()
    assert [(o.seq, o.text, o.data) for o in out] == [
        (3, "hello", b""),
        (4, "", b"wav"),
        (5, "!", b""),
    ]
    assert out[-1].finished


def test_start_at_affects_only_its_own_request() -> None:
    c = OutputCoalescer()
    c.start_at("retried", 10)
    c.add(chunk("retried", "x"))
    c.add(chunk("fresh", "y"))
    assert {o.request_id: o.seq for o in c.drain()} == {"retried": 10, "fresh": 0}


def test_a_finished_retry_forgets_its_start_so_a_reused_id_starts_at_zero() -> None:
    c = OutputCoalescer()
    c.start_at("r", 4)
    c.add(chunk("r", "done", finished=True))
    assert [o.seq for o in c.drain()] == [4]
    c.add(chunk("r", "new"))
    assert [o.seq for o in c.drain()] == [0]


def test_forget_drops_the_numbering_of_an_aborted_request() -> None:
    c = OutputCoalescer()
    c.start_at("r", 5)
    c.add(chunk("r", "a"))
    c.drain()
    c.forget("r")
    c.add(chunk("r", "b"))  # a later request with the same id starts over
    assert [o.seq for o in c.drain()] == [0]


def test_forget_of_an_unknown_request_is_harmless() -> None:
    c = OutputCoalescer()
    c.forget("nope")
    assert not c
