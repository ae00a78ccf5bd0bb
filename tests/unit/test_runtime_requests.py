"""The replica runtime's request bookkeeping, with a real echo engine and no sockets.

Output frames are captured instead of sent; everything else (decoding the head's
batch, starting, aborting and resuming requests, numbering chunks) is the real code.
"""

from __future__ import annotations

import asyncio

from omnistage.config.schema import StageConfig
from omnistage.engines import build_engine
from omnistage.protocol import codec
from omnistage.protocol.messages import Abort, AddRequest, OutputChunk, Prompt, Resume
from omnistage.replica.runtime import ReplicaOptions, ReplicaRuntime


def _runtime(**engine_args: object) -> tuple[ReplicaRuntime, list[OutputChunk]]:
    rt = ReplicaRuntime(ReplicaOptions(stage_id=0, master_host="127.0.0.1", master_port=1))
    stage = StageConfig(stage_id=0, name="echo", engine="echo", engine_args=engine_args)
    rt._engine = build_engine(stage)
    sent: list[OutputChunk] = []

    def capture() -> None:
        sent.extend(rt._outputs.drain())

    rt._flush = capture  # type: ignore[method-assign]
    return rt, sent


def _batch(*messages: object) -> list[bytes]:
    frames: list[bytes] = []
    for m in messages:
        frames.extend(codec.encode(m))  # type: ignore[arg-type]
    return frames


async def _settle(rt: ReplicaRuntime) -> None:
    for _ in range(200):
        if not rt._requests:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.02)


def _add(rid: str, text: str, resume: Resume | None = None) -> AddRequest:
    return AddRequest(rid, Prompt(text=text), [], {}, resume)


async def test_abort_then_retry_in_one_batch_runs_the_retry_numbered_from_resume() -> None:
    rt, sent = _runtime(num_chunks=4, chunk_delay_s=0.02, suffix="!")
    rt._on_frames(_batch(_add("r", "abcdefgh")))
    await asyncio.sleep(0.05)  # a chunk or two out
    sent.clear()
    # The head took the request back (a silent replica) and then gave it to us again.
    rt._on_frames(_batch(Abort("r"), _add("r", "abcdefgh", Resume("ab", 0, 7))))
    await _settle(rt)
    mine = [c for c in sent if c.request_id == "r"]
    assert mine, "the retry produced nothing: it was taken for a duplicate"
    assert [c.seq for c in mine] == list(range(7, 7 + len(mine)))
    assert "".join(c.text for c in mine) == "cdefgh!"
    assert mine[-1].finished


async def test_a_resumed_rerun_drops_what_the_client_already_has() -> None:
    rt, sent = _runtime(num_chunks=3, suffix=" [s]")
    rt._on_frames(_batch(_add("q", "hello world", Resume("hello w", 0, 2))))
    await _settle(rt)
    assert "".join(c.text for c in sent) == "orld [s]"
    assert sent[0].seq == 2 and sent[-1].finished


async def test_a_plain_abort_stops_the_request_and_frees_its_numbering() -> None:
    rt, sent = _runtime(num_chunks=8, chunk_delay_s=0.05)
    rt._on_frames(_batch(_add("z", "abcdefgh")))
    await asyncio.sleep(0.08)
    rt._on_frames(_batch(Abort("z")))
    await _settle(rt)
    assert not rt._requests
    assert not any(c.finished for c in sent)
    assert "z" not in rt._outputs._next_seq
