"""The replica's request runner with a real echo engine and no sockets: outputs are
captured by a recording Outlet; decoding, starting, aborting, resuming, numbering and
routing (head or peers) are the real code."""

from __future__ import annotations

import pytest

from omnistage.config.schema import StageConfig
from omnistage.engines import build_engine
from omnistage.engines.echo import EchoEngine
from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.messages import (
    Abort,
    AddRequest,
    OutputChunk,
    PeerConnector,
    Prompt,
    Redirect,
    Resume,
)
from omnistage.replica.early_inputs import EARLY_TTL_S
from omnistage.replica.requests import RequestRunner
from tests.unit.fakes import FakeClock, others_done, ticks, until


class Recorder:
    def __init__(self) -> None:
        self.head: list[OutputChunk] = []
        self.peers: dict[str, list[OutputChunk]] = {}
        self.connectors: dict[str, set[str]] = {}

    def to_head(self, chunks: list[OutputChunk]) -> None:
        self.head.extend(chunks)

    def to_peer(self, address: str, chunks: list[OutputChunk], connector: PeerConnector) -> None:
        self.peers.setdefault(address, []).extend(chunks)
        self.connectors.setdefault(address, set()).add(connector.name)


def _runner(
    stage_id: int = 0, clock: FakeClock | None = None, **engine_args: object
) -> tuple[RequestRunner, Recorder]:
    stage = StageConfig(stage_id=stage_id, name="echo", engine="echo", engine_args=engine_args)
    runner = RequestRunner(stage_id, build_engine(stage), lambda _why: None, clock or FakeClock())
    out = Recorder()
    runner.bind(replica_id=3, epoch=7, outlet=out)
    return runner, out


def _add(rid: str, text: str, resume: Resume | None = None, **kw: object) -> AddRequest:
    return AddRequest(rid, Prompt(text=text), [], {}, resume, **kw)  # type: ignore[arg-type]


def _input(rid: str, source: int, text: str, finished: bool, attempt: int = 0) -> OutputChunk:
    return OutputChunk(rid, source, 0, 1, 0, "text", text, finished=finished, attempt=attempt)


async def test_abort_then_retry_in_one_batch_runs_the_retry_numbered_from_resume() -> None:
    runner, out = _runner(num_chunks=4, chunk_delay_s=0.02, suffix="!")
    runner.handle(_add("r", "abcdefgh"))
    await until(lambda: out.head, what="a first chunk out")
    out.head.clear()
    # The head took the request back (a silent replica) and then gave it to us again.
    runner.handle(Abort("r"))
    runner.handle(_add("r", "abcdefgh", Resume("ab", 0, 7)))
    await others_done()
    mine = [c for c in out.head if c.request_id == "r"]
    assert mine, "the retry produced nothing: it was taken for a duplicate"
    assert [c.seq for c in mine] == list(range(7, 7 + len(mine)))
    assert "".join(c.text for c in mine) == "cdefgh!"
    assert mine[-1].finished
    assert (mine[0].replica_id, mine[0].epoch) == (3, 7)


async def test_a_resumed_rerun_drops_what_the_client_already_has() -> None:
    runner, out = _runner(num_chunks=3, suffix=" [s]")
    runner.handle(_add("q", "hello world", Resume("hello w", 0, 2)))
    await others_done()
    assert "".join(c.text for c in out.head) == "orld [s]"
    assert out.head[0].seq == 2 and out.head[-1].finished


async def test_a_plain_abort_stops_the_request_and_frees_its_numbering() -> None:
    runner, out = _runner(num_chunks=8, chunk_delay_s=0.05)
    runner.handle(_add("z", "abcdefgh"))
    await until(lambda: out.head, what="a first chunk out")
    runner.handle(Abort("z"))
    await others_done()
    assert not runner.requests
    assert not any(c.finished for c in out.head)
    assert "z" not in runner._outputs._next_seq


async def test_outputs_go_to_peers_and_only_the_last_chunk_to_the_head() -> None:
    runner, out = _runner(num_chunks=4, chunk_delay_s=0.01, suffix="")
    runner.handle(_add("p", "abcdefgh", peers=["tcp://a:1", "tcp://b:2"], head_all=False))
    await others_done()
    for peer in ("tcp://a:1", "tcp://b:2"):
        assert "".join(c.text for c in out.peers[peer]) == "abcdefgh"
        assert out.peers[peer][-1].finished
    assert len(out.head) == 1 and out.head[0].finished


async def test_each_peer_gets_its_tensors_through_the_connector_the_head_named() -> None:
    runner, out = _runner(num_chunks=4, chunk_delay_s=0.01, suffix="", tensor_bytes=64)
    shm = PeerConnector("shm", {"segment_bytes": 1 << 20})
    # One connector named for two peers: the other takes zmq.
    add = _add("p", "abcdefgh", peers=["tcp://a:1", "tcp://b:2"], head_all=False)
    add.connectors = [shm]
    runner.handle(add)
    await others_done()
    assert out.connectors == {"tcp://a:1": {"shm"}, "tcp://b:2": {"zmq"}}
    for peer in ("tcp://a:1", "tcp://b:2"):
        tensors = [c for c in out.peers[peer] if c.data]
        assert [c.meta.shape for c in tensors] == [(64,)] * 4  # type: ignore[union-attr]
    # The head gets the last chunk, which carries text, not a tensor.
    assert len(out.head) == 1 and not out.head[0].data


async def test_head_all_sends_every_chunk_to_the_head_as_well() -> None:
    runner, out = _runner(num_chunks=4, chunk_delay_s=0.01, suffix="")
    runner.handle(_add("p", "abcdefgh", peers=["tcp://a:1"], head_all=True))
    await others_done()
    assert "".join(c.text for c in out.head) == "abcdefgh"
    assert [c.seq for c in out.head] == [c.seq for c in out.peers["tcp://a:1"]]


async def test_inputs_that_arrive_before_the_add_request_are_kept_for_it() -> None:
    runner, out = _runner(stage_id=1, suffix=" [1]")
    # An upstream replica's pushes can overtake the head's AddRequest.
    runner.feed(_input("e", 0, "early ", False, attempt=2))
    runner.feed(_input("e", 0, "bird", True, attempt=2))
    runner.feed(_input("e", 0, "stale", True, attempt=1))  # an earlier attempt's
    runner.handle(AddRequest("e", None, [0], {}, attempt=2))
    await others_done()
    assert "".join(c.text for c in out.head) == "early bird [1]"
    assert all(c.attempt == 2 for c in out.head)


async def test_inputs_of_another_attempt_are_dropped() -> None:
    runner, out = _runner(stage_id=1, suffix="")
    runner.handle(AddRequest("a", None, [0], {}, attempt=1))
    runner.feed(_input("a", 0, "old", False, attempt=0))
    runner.feed(_input("a", 0, "new", True, attempt=1))
    await others_done()
    assert "".join(c.text for c in out.head) == "new"


async def test_early_inputs_are_dropped_once_older_than_the_ttl() -> None:
    clock = FakeClock()
    runner, out = _runner(stage_id=1, clock=clock, suffix="")
    runner.feed(_input("old", 0, "stale", True))
    clock.now += EARLY_TTL_S + 1
    runner.feed(_input("new", 0, "fresh", True))  # a feed past the TTL sweeps the old ones
    runner.handle(AddRequest("old", None, [0], {}))
    runner.handle(AddRequest("new", None, [0], {}))
    await until(lambda: out.head and out.head[-1].finished, what="new to finish")
    await ticks()
    assert [(c.request_id, c.text) for c in out.head] == [("new", "fresh")]
    runner.handle(Abort("old"))  # it would wait for its input forever
    await others_done()


class _Picky(EchoEngine):
    """An echo engine that refuses params with "bad" set, as TTS refuses a voice."""

    def check(self, params: dict[str, object]) -> None:
        if params.get("bad"):
            raise BadRequestError("bad is not allowed here", param="bad")


def _picky() -> tuple[RequestRunner, Recorder]:
    stage = StageConfig(stage_id=1, name="picky", engine="echo")
    runner = RequestRunner(1, _Picky(stage), lambda _why: None)
    out = Recorder()
    runner.bind(replica_id=0, epoch=1, outlet=out)
    return runner, out


async def test_an_ack_request_answers_at_once_with_an_empty_chunk_then_runs() -> None:
    runner, out = _picky()
    runner.handle(AddRequest("k", None, [0], {}, ack=True))
    runner.flush()  # what the first tick sends, before any input arrived
    (ack,) = out.head
    assert (ack.seq, ack.text, ack.data, ack.finished, ack.error) == (0, "", b"", False, None)
    runner.feed(_input("k", 0, "hi", True))
    await others_done()
    assert "".join(c.text for c in out.head) == "hi [picky]"
    assert [c.seq for c in out.head] == list(range(len(out.head)))


async def test_an_ack_request_with_bad_params_is_refused_before_any_work() -> None:
    runner, out = _picky()
    runner.handle(AddRequest("k", None, [0], {"bad": True}, ack=True))
    await others_done()
    (refusal,) = out.head
    assert refusal.finished and refusal.error_kind == "bad_request"
    assert refusal.error_param == "bad" and not runner.requests


async def test_a_final_stage_sends_its_tensors_to_the_peers_only() -> None:
    runner, out = _runner(num_chunks=4, chunk_delay_s=0.01, suffix="", tensor_bytes=16)
    runner.handle(_add("t", "abcdefgh", peers=["tcp://a:1"], peer_tensors=True))
    await others_done()
    assert "".join(c.text for c in out.head) == "abcdefgh"
    assert not any(c.data for c in out.head) and out.head[-1].finished
    assert len([c for c in out.peers["tcp://a:1"] if c.data]) == 4
    assert "".join(c.text for c in out.peers["tcp://a:1"]) == "abcdefgh"


async def test_a_redirect_sends_a_new_peer_all_that_was_kept_then_the_rest() -> None:
    runner, out = _runner(num_chunks=6, chunk_delay_s=0.01, suffix="", tensor_bytes=16)
    runner.handle(_add("t", "abcdefghijkl", peers=["tcp://a:1"], peer_tensors=True))
    await until(lambda: len(out.peers.get("tcp://a:1", [])) >= 4, what="some chunks out")
    runner.handle(Redirect("t", 2, ["tcp://b:2"], [PeerConnector("zmq")], ["tcp://a:1"]))
    await others_done()
    old, new = out.peers["tcp://a:1"], out.peers["tcp://b:2"]
    assert len(old) < len(new) and not old[-1].finished  # the lost peer got no more
    # The new peer has the whole request, in order, as its (later) attempt's input.
    assert [c.seq for c in new] == list(range(len(new)))
    assert "".join(c.text for c in new) == "abcdefghijkl" and new[-1].finished
    assert len([c for c in new if c.data]) == 6
    assert {c.attempt for c in new} == {2}
    assert {c.attempt for c in out.head} == {0}  # the head's numbering is its own
    assert "".join(c.text for c in out.head) == "abcdefghijkl"


async def test_what_was_kept_outlives_the_stage_until_the_head_ends_the_request() -> None:
    runner, out = _runner(num_chunks=2, suffix="", tensor_bytes=16)
    runner.handle(_add("t", "abcd", peers=["tcp://a:1"], peer_tensors=True))
    await others_done()
    assert not runner.requests  # done generating
    sent = out.peers["tcp://a:1"]
    runner.handle(Redirect("t", 1, ["tcp://b:2"], [], ["tcp://a:1"]))
    assert [(c.seq, c.text, c.data) for c in out.peers["tcp://b:2"]] == [
        (c.seq, c.text, c.data) for c in sent
    ]
    runner.handle(Abort("t"))  # the request is over: nothing kept any more
    assert runner._routes.kept_chunks() == 0
    runner.handle(Redirect("t", 2, ["tcp://c:3"], [], []))
    assert "tcp://c:3" not in out.peers


async def test_a_redirect_for_which_nothing_was_kept_is_answered_to_the_head() -> None:
    runner, out = _runner(num_chunks=2, suffix="", tensor_bytes=16)
    runner.handle(Redirect("gone", 4, ["tcp://b:2"], [], ["tcp://a:1"]))
    assert "tcp://b:2" not in out.peers
    (answer,) = out.head
    assert (answer.request_id, answer.error_kind, answer.attempt) == ("gone", "not_kept", 4)
    assert (answer.stage_id, answer.replica_id, answer.epoch) == (0, 3, 7)
    assert not answer.finished


async def test_a_rerun_feeds_its_peers_all_and_the_head_only_what_it_lacks() -> None:
    runner, out = _runner(num_chunks=4, suffix="", tensor_bytes=16)
    add = _add("t", "abcdefgh", Resume("abcd", 0, 5), peers=["tcp://a:1"], peer_tensors=True)
    runner.handle(add)
    await others_done()
    # The peers run again from their start: every tensor, all the text.
    sent = out.peers["tcp://a:1"]
    assert "".join(c.text for c in sent) == "abcdefgh" and len([c for c in sent if c.data]) == 4
    # The client has "abcd": the head gets the rest, numbered on from the resume.
    assert "".join(c.text for c in out.head) == "efgh" and not any(c.data for c in out.head)
    seqs = [c.seq for c in out.head]
    assert seqs == sorted(set(seqs)) and seqs[0] >= 5
    # What it keeps for a redirect is what the peers got.
    runner.handle(Redirect("t", 1, ["tcp://b:2"], [], ["tcp://a:1"]))
    assert [c.text for c in out.peers["tcp://b:2"]] == [c.text for c in sent]


async def test_a_stage_that_is_not_told_to_keep_keeps_nothing() -> None:
    runner, out = _runner(num_chunks=2, suffix="", tensor_bytes=16)
    runner.handle(_add("t", "abcd", peers=["tcp://a:1"], head_all=False))
    await others_done()
    assert runner._routes.kept_chunks() == 0
    assert len([c for c in out.head if c.data]) == 0


async def test_a_replica_keeps_the_chunks_of_a_bounded_number_of_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("omnistage.replica.peer_routes.MAX_KEPT", 2)
    runner, out = _runner(num_chunks=1, suffix="", tensor_bytes=16)
    for rid in ("a", "b", "c"):  # their ends never came (no Abort)
        runner.handle(_add(rid, "xy", peers=["tcp://a:1"], peer_tensors=True))
    await others_done()
    runner.handle(Redirect("a", 1, ["tcp://b:2"], [], []))  # the oldest: dropped
    runner.handle(Redirect("c", 1, ["tcp://c:3"], [], []))
    assert "tcp://b:2" not in out.peers
    assert [c.request_id for c in out.peers["tcp://c:3"]] == ["c"] * 2
