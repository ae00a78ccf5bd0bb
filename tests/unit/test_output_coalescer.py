"""Output coalescing in the replica: merges text produced in one tick, nothing else."""

from __future__ import annotations

from omnistage.protocol.messages import OutputChunk, Usage
from omnistage.replica.outputs import OutputCoalescer


def chunk(rid: str, text: str = "", **kw: object) -> OutputChunk:
    return OutputChunk(
        request_id=rid,
        stage_id=0,
        replica_id=0,
        epoch=1,
        seq=-1,
        modality="text",
        text=text,
        **kw,  # type: ignore[arg-type]
    )


def test_consecutive_text_of_one_request_merges_into_one_chunk() -> None:
    c = OutputCoalescer()
    c.add(chunk("a", "hel"))
    c.add(chunk("a", "lo"))
    c.add(chunk("a", "!", finished=True, finish_reason="stop", usage=Usage(completion_tokens=3)))
    (out,) = c.drain()
    assert out.text == "hello!"
    assert out.finished and out.finish_reason == "stop"
    assert out.usage == Usage(completion_tokens=3)
    assert out.seq == 0


def test_requests_are_kept_apart_and_in_order() -> None:
    c = OutputCoalescer()
    c.add(chunk("a", "1"))
    c.add(chunk("b", "x"))
    c.add(chunk("a", "2"))
    out = c.drain()
    assert [(o.request_id, o.text) for o in out] == [("a", "12"), ("b", "x")]


def test_sequence_numbers_continue_across_ticks_and_restart_after_finish() -> None:
    c = OutputCoalescer()
    c.add(chunk("a", "1"))
    assert [o.seq for o in c.drain()] == [0]
    c.add(chunk("a", "2"))
    c.add(chunk("a", "3", finished=True))
    assert [o.seq for o in c.drain()] == [1]
    c.add(chunk("a", "again"))  # a new request reusing the id starts over
    assert [o.seq for o in c.drain()] == [0]


def test_binary_and_non_text_chunks_are_never_merged() -> None:
    c = OutputCoalescer()
    audio = [
        OutputChunk("a", 0, 0, 1, -1, "audio", data=b"RIFF1"),
        OutputChunk("a", 0, 0, 1, -1, "audio", data=b"RIFF2"),
    ]
    for a in audio:
        c.add(a)
    out = c.drain()
    assert [o.data for o in out] == [b"RIFF1", b"RIFF2"]
    assert [o.seq for o in out] == [0, 1]


def test_an_error_chunk_is_not_merged_into() -> None:
    c = OutputCoalescer()
    c.add(chunk("a", "partial", error="boom", finished=True))
    c.add(chunk("a", "late"))
    out = c.drain()
    assert [o.text for o in out] == ["partial", "late"]
    assert not c
