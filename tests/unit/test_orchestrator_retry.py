"""The orchestrator re-dispatches a failed replica's requests: a real Orchestrator,
StageGraph and StagePools, with replica state changes and output chunks fed in by hand
and every message the head would send recorded instead of sent."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest

from omnistage.config.load import load_config
from omnistage.control.balancing import make_policy
from omnistage.control.replica_table import ReplicaEntry, Transition
from omnistage.dataplane.graph import StageGraph
from omnistage.dataplane.orchestrator import Orchestrator, RequestStream
from omnistage.dataplane.stage_pool import StagePool
from omnistage.protocol import codec
from omnistage.protocol.enums import ErrorKind
from omnistage.protocol.errors import (
    StageFailedError,
    StageOverloadedError,
    StageUnavailableError,
)
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import (
    Abort,
    AddRequest,
    OutputChunk,
    PeerConnector,
    Prompt,
    Reason,
    Redirect,
    ReplicaState,
    Resume,
    Usage,
    routing_id,
)
from omnistage.protocol.params import StageParams
from tests.unit.fakes import replica_entry, ticks, until

PROMPT = Prompt(text="hi")


class FakeChannels:
    """Stands in for DataChannels: the orchestrator only ever calls ``post``."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Any]] = []

    def post(self, identity: bytes, msg: Any) -> None:
        # As sent: encoded now (DataChannels encodes at once), so later changes to the
        # object do not show.
        self.sent.append((identity, codec.decode(*codec.encode(msg))))

    def take(self) -> list[tuple[bytes, Any]]:
        out, self.sent = self.sent, []
        return out


def ident(sid: int, rid: int, epoch: int = 1) -> bytes:
    return routing_id(sid, rid, epoch)


def entry(
    sid: int, rid: int, state: ReplicaState, epoch: int = 1, peers: bool = False
) -> ReplicaEntry:
    e = replica_entry(rid, state, capacity=4, epoch=epoch, sid=sid)
    # Replicas that listen for peers take upstream outputs straight from them.
    e.peer_address = f"tcp://127.0.0.1:{7000 + 10 * sid + rid}" if peers else ""
    return e


class Head:
    def __init__(
        self,
        pipeline: str,
        replicas: dict[int, int],
        max_retries: int = 2,
        no_replica_wait_s: float = 1.0,
        peers: bool = False,
    ) -> None:
        config = load_config(pipeline)
        self.peers = peers
        self.channels = FakeChannels()
        self.pools = {
            s.stage_id: StagePool(s.stage_id, s.name, make_policy("round-robin"))
            for s in config.stages
        }
        self.orch = Orchestrator(
            StageGraph(config),
            self.pools,
            self.channels,  # type: ignore[arg-type]
            no_replica_wait_s=no_replica_wait_s,
            max_retries=max_retries,
        )
        for sid, n in replicas.items():
            for rid in range(n):
                self.up(sid, rid)

    def up(self, sid: int, rid: int, epoch: int = 1) -> None:
        e = entry(sid, rid, ReplicaState.UP, epoch, self.peers)
        self.orch.on_transition(Transition(e, ReplicaState.STARTING, ReplicaState.UP, Reason.READY))

    def fail(
        self, sid: int, rid: int, epoch: int = 1, reason: Reason = Reason.PROCESS_EXITED
    ) -> None:
        e = entry(sid, rid, ReplicaState.ERROR, epoch, self.peers)
        self.orch.on_transition(Transition(e, ReplicaState.UP, ReplicaState.ERROR, reason))

    def out(
        self, sid: int, rid: int, seq: int, text: str, epoch: int = 1, **kw: Any
    ) -> OutputChunk:
        chunk = OutputChunk("r1", sid, rid, epoch, seq, "text", text=text, **kw)
        self.orch.on_outputs([chunk])
        return chunk

    def replica_of(self, sid: int) -> int:
        """The replica of ``sid`` the (only) request is bound to now."""
        (handle,) = [h for h in self.pools[sid].replicas.values() if "r1" in h.requests]
        return handle.replica_id

    def slots_in_use(self) -> int:
        return sum(h.in_flight for p in self.pools.values() for h in p.replicas.values())


async def collect(stream: RequestStream) -> list[OutputChunk]:
    return await asyncio.wait_for(_collect(stream), 5)


async def _collect(stream: RequestStream) -> list[OutputChunk]:
    return [o async for o in stream]


def add(
    sid_upstream: list[int], resume: Resume | None, prompt: Prompt | None = None, **kw: Any
) -> AddRequest:
    # Direct edges of a pipeline without omni_kv_config take zmq.
    kw.setdefault("connectors", [PeerConnector("zmq")] * len(kw.get("peers", [])))
    return AddRequest("r1", prompt, sid_upstream, StageParams(), resume, **kw)


def inp(source: int, rid: int, seq: int, text: str, finished: bool = False) -> OutputChunk:
    """An output of ``source``'s replica ``rid`` as the head forwards it."""
    return OutputChunk("r1", source, rid, 1, seq, "text", text, finished=finished)


async def test_downstream_retry_sends_resume_and_replays_the_stage_inputs() -> None:
    head = Head("echo", {0: 1, 1: 2, 2: 1})
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [2]))
    failing = head.replica_of(1)
    other = 1 - failing
    # Every stage is bound at once; with no peer listeners, all edges go via the head.
    assert head.channels.take() == [
        (ident(0, 0), add([], None, PROMPT)),
        (ident(1, failing), add([0], None)),
        (ident(2, 0), add([1], None)),
    ]
    head.out(0, 0, 0, "hel")
    head.out(0, 0, 1, "lo")
    head.out(1, failing, 0, "HEL")
    assert head.channels.take() == [
        (ident(1, failing), inp(0, 0, 0, "hel")),
        (ident(1, failing), inp(0, 0, 1, "lo")),
        (ident(2, 0), inp(1, failing, 0, "HEL")),
    ]

    head.fail(1, failing)
    # The failed replica is told to stop (it may only be silent); the other replica
    # gets the request with what was delivered and every input the stage had so far,
    # stamped with the new attempt.
    replayed = [inp(0, 0, 0, "hel"), inp(0, 0, 1, "lo")]
    for chunk in replayed:
        chunk.attempt = 1
    assert head.channels.take() == [
        (ident(1, failing), Abort("r1")),
        (ident(1, other), add([0], Resume(text="HEL", data_chunks=0, seq=1), attempt=1)),
        *((ident(1, other), chunk) for chunk in replayed),
    ]
    assert head.orch.retried_total == 1

    # Later inputs go to the replacement only; the vocoder keeps its replica.
    head.out(0, 0, 2, "!", finished=True)
    forwarded = inp(0, 0, 2, "!", finished=True)
    forwarded.attempt = 1
    assert head.channels.take() == [(ident(1, other), forwarded)]
    head.out(1, other, 1, "LO!", finished=True, attempt=1)
    assert head.channels.take() == [(ident(2, 0), inp(1, other, 1, "LO!", finished=True))]
    head.out(2, 0, 0, "HELLO!", finished=True, finish_reason="stop")

    outputs = await collect(stream)
    assert [(o.stage_id, o.text, o.finished) for o in outputs] == [(2, "HELLO!", True)]
    assert head.slots_in_use() == 0


async def test_a_chunk_below_the_next_expected_seq_is_not_delivered_twice() -> None:
    head = Head("echo-1stage", {0: 2})
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0]))
    failing = head.replica_of(0)
    other = 1 - failing
    head.out(0, failing, 0, "ab")
    head.out(0, failing, 1, "cd")
    head.channels.take()
    head.fail(0, failing)
    assert head.channels.take() == [
        (ident(0, failing), Abort("r1")),
        (ident(0, other), add([], Resume(text="abcd", data_chunks=0, seq=2), PROMPT, attempt=1)),
    ]
    # The replacement sends again what the head already has, then what is new.
    head.out(0, other, 0, "ab", attempt=1)
    head.out(0, other, 1, "cd", attempt=1)
    head.out(0, other, 2, "ef", finished=True, finish_reason="stop", attempt=1)
    outputs = await collect(stream)
    assert [o.text for o in outputs] == ["ab", "cd", "ef"]
    assert outputs[-1].finished and outputs[-1].finish_reason == "stop"
    assert head.slots_in_use() == 0


async def test_a_source_stage_retry_does_not_forward_duplicates_downstream() -> None:
    head = Head("echo", {0: 2, 1: 1, 2: 1})
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [2]))
    failing = head.replica_of(0)
    other = 1 - failing
    head.out(0, failing, 0, "a")
    head.channels.take()
    head.fail(0, failing)
    sent = head.channels.take()
    resume = Resume(text="a", data_chunks=0, seq=1)
    assert sent[1] == (ident(0, other), add([], resume, PROMPT, attempt=1))
    head.out(0, other, 0, "a", attempt=1)  # already forwarded to the talker: dropped
    head.out(0, other, 1, "b", finished=True, attempt=1)
    assert head.channels.take() == [(ident(1, 0), inp(0, other, 1, "b", finished=True))]
    head.out(1, 0, 0, "AB", finished=True)
    head.out(2, 0, 0, "AB!", finished=True)
    assert [o.text for o in await collect(stream)] == ["AB!"]


async def test_chunks_from_the_failed_replica_after_the_retry_are_ignored() -> None:
    head = Head("echo-1stage", {0: 3})
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0]))
    first = head.replica_of(0)
    head.out(0, first, 0, "ab")
    head.fail(0, first)
    second = head.replica_of(0)
    assert second != first
    # Output the failed replica had in flight arrives late, with seq numbers the head
    # has not seen: it must not count, in the stream or in the next Resume.
    head.out(0, first, 1, "XX")
    head.out(0, first, 2, "YY", finished=True)
    head.out(0, second, 1, "cd", attempt=1)
    head.channels.take()
    head.fail(0, second)
    third = head.replica_of(0)
    assert third not in (first, second)
    adds = [m for _, m in head.channels.take() if isinstance(m, AddRequest)]
    assert adds == [add([], Resume(text="abcd", data_chunks=0, seq=2), PROMPT, attempt=2)]
    head.out(0, first, 3, "ZZ")  # still ignored
    head.out(0, third, 2, "ef", finished=True, attempt=2)
    assert [o.text for o in await collect(stream)] == ["ab", "cd", "ef"]


async def test_output_of_an_old_incarnation_is_ignored_when_its_slot_returns() -> None:
    # The only replica dies and is restarted (same replica id, new epoch); the retry
    # waits for it. Late output from the dead incarnation must not be taken as the new
    # one's.
    head = Head("echo-1stage", {0: 1}, no_replica_wait_s=5.0)
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0]))
    head.out(0, 0, 0, "ab")
    head.channels.take()
    head.fail(0, 0)
    assert head.channels.take() == [(ident(0, 0), Abort("r1"))]
    await ticks()  # the retry is waiting for a replica, not failing
    assert head.channels.take() == []
    head.up(0, 0, epoch=2)
    await until(lambda: head.channels.sent, what="the retry dispatched")
    resume = Resume(text="ab", data_chunks=0, seq=1)
    assert head.channels.take() == [(ident(0, 0, epoch=2), add([], resume, PROMPT, attempt=1))]
    head.out(0, 0, 1, "OLD", epoch=1)
    head.out(0, 0, 1, "cd", epoch=2, finished=True, attempt=1)
    assert [o.text for o in await collect(stream)] == ["ab", "cd"]


async def test_a_retry_waits_past_the_stage_wait_for_the_replica_the_head_restarts() -> None:
    head = Head("echo-1stage", {0: 1}, no_replica_wait_s=0.05)
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0]))
    head.out(0, 0, 0, "ab")
    # The head restarts its replica (the restart is announced before the ERROR).
    head.pools[0].restart(0, time.monotonic())
    head.fail(0, 0)
    head.channels.take()
    await asyncio.sleep(0.3)  # six times the stage wait: still waiting, not failed
    assert head.channels.take() == []
    head.up(0, 0, epoch=2)
    await until(lambda: head.channels.sent, what="the retry dispatched")
    resume = Resume(text="ab", data_chunks=0, seq=1)
    assert head.channels.take() == [(ident(0, 0, epoch=2), add([], resume, PROMPT, attempt=1))]
    head.out(0, 0, 1, "cd", epoch=2, finished=True, attempt=1)
    assert [o.text for o in await collect(stream)] == ["ab", "cd"]


async def test_a_new_request_waits_for_a_restarting_replica_instead_of_a_503() -> None:
    head = Head("echo", {0: 1, 1: 1, 2: 1}, no_replica_wait_s=0.05)
    head.pools[1].restart(0, time.monotonic())
    head.fail(1, 0)
    opening = asyncio.create_task(head.orch.open(PipelineRequest("r1", PROMPT, [2])))
    await asyncio.sleep(0.3)
    assert not opening.done()
    assert head.pools[1].waiting == 1
    head.up(1, 0, epoch=2)
    stream = await asyncio.wait_for(opening, 1)
    assert {i for i, m in head.channels.take() if isinstance(m, AddRequest)} == {
        ident(0, 0),
        ident(1, 0, epoch=2),
        ident(2, 0),
    }
    stream.close()


async def test_a_stage_nothing_will_serve_is_judged_before_a_long_wait_for_another() -> None:
    head = Head("echo", {0: 1, 1: 1, 2: 1}, no_replica_wait_s=0.05)
    head.pools[0].restart(0, time.monotonic())
    head.fail(0, 0)  # coming back
    head.fail(2, 0)  # not coming back
    started = time.monotonic()
    with pytest.raises(StageUnavailableError) as info:
        await head.orch.open(PipelineRequest("r1", PROMPT, [2]))
    assert time.monotonic() - started < 1
    message = str(info.value)
    assert message.startswith("stage 2 (vocoder) has no live replica and none is restarting")


async def test_inputs_arriving_while_a_retry_waits_are_sent_once_with_the_dispatch() -> None:
    head = Head("echo", {0: 1, 1: 1, 2: 1}, no_replica_wait_s=5.0)
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [2]))
    head.out(0, 0, 0, "a")
    head.fail(1, 0)
    head.channels.take()
    head.out(0, 0, 1, "b")  # the talker has no replica now: kept, not sent anywhere
    head.out(0, 0, 2, "c", finished=True)
    assert head.channels.take() == []
    head.up(1, 1)
    await until(lambda: head.channels.sent, what="the retry dispatched")
    replayed = [inp(0, 0, 0, "a"), inp(0, 0, 1, "b"), inp(0, 0, 2, "c", finished=True)]
    for chunk in replayed:
        chunk.attempt = 1
    assert head.channels.take() == [
        (ident(1, 1), add([0], Resume(text="", data_chunks=0, seq=0), attempt=1)),
        *((ident(1, 1), chunk) for chunk in replayed),
    ]
    head.out(1, 1, 0, "ABC", finished=True, attempt=1)
    head.out(2, 0, 0, "ABC!", finished=True)
    assert [o.text for o in await collect(stream)] == ["ABC!"]


async def test_a_drain_cut_short_moves_the_requests_without_an_abort() -> None:
    head = Head("echo-1stage", {0: 2})
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0]))
    leaving = head.replica_of(0)
    other = 1 - leaving
    head.out(0, leaving, 0, "ab")
    head.channels.take()
    e = entry(0, leaving, ReplicaState.DRAINING)
    head.orch.on_transition(Transition(e, ReplicaState.UP, ReplicaState.DRAINING, Reason.DRAINING))
    assert head.channels.take() == []  # draining: it finishes what it has
    e = entry(0, leaving, ReplicaState.DOWN)
    head.orch.on_transition(
        Transition(e, ReplicaState.DRAINING, ReplicaState.DOWN, Reason.SHUT_DOWN)
    )
    # It said goodbye, so it is gone: nothing to abort, the request just moves.
    resume = Resume(text="ab", data_chunks=0, seq=1)
    assert head.channels.take() == [(ident(0, other), add([], resume, PROMPT, attempt=1))]
    head.out(0, other, 1, "cd", finished=True, attempt=1)
    assert [o.text for o in await collect(stream)] == ["ab", "cd"]


async def test_data_chunks_delivered_so_far_are_counted_in_the_resume() -> None:
    head = Head("echo-1stage", {0: 2})
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0]))
    failing = head.replica_of(0)
    head.orch.on_outputs(
        [
            OutputChunk("r1", 0, failing, 1, 0, "audio", text="Hi. ", data=b"wav0"),
            OutputChunk("r1", 0, failing, 1, 1, "audio", data=b"wav1"),
        ]
    )
    head.channels.take()
    head.fail(0, failing)
    adds = [m for _, m in head.channels.take() if isinstance(m, AddRequest)]
    assert [a.resume for a in adds] == [Resume(text="Hi. ", data_chunks=2, seq=2)]
    stream.close()


async def test_the_tokens_behind_the_delivered_text_go_with_the_resume() -> None:
    # A grammar may make an LLM write text in more tokens than re-encoding it gives:
    # the retry must know the count the failed replica reported.
    head = Head("echo-1stage", {0: 2})
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0]))
    failing = head.replica_of(0)
    usage = Usage(prompt_tokens=9, completion_tokens=3)
    head.orch.on_outputs([OutputChunk("r1", 0, failing, 1, 0, "text", '{"a":', usage=usage)])
    head.channels.take()
    head.fail(0, failing)
    adds = [m for _, m in head.channels.take() if isinstance(m, AddRequest)]
    assert [a.resume for a in adds] == [Resume(text='{"a":', data_chunks=0, seq=1, tokens=3)]
    stream.close()


@pytest.mark.parametrize("max_retries", [0, 1, 2])
async def test_after_max_retries_failures_the_request_fails_naming_the_flag(
    max_retries: int,
) -> None:
    head = Head("echo-1stage", {0: 4}, max_retries=max_retries)
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0]))
    used = []
    for _ in range(max_retries):
        used.append(head.replica_of(0))
        head.fail(0, used[-1])
    last = head.replica_of(0)
    head.fail(0, last, reason=Reason.STALLED)
    with pytest.raises(StageFailedError) as info:
        await collect(stream)
    message = str(info.value)
    assert "--omni-max-retries" in message
    assert f"gave up after {max_retries} retries" in message
    assert f"replica {last} went ERROR: {Reason.STALLED}" in message
    assert head.orch.retried_total == max_retries
    # Never more than 1 + max_retries replicas tried; every slot released.
    adds = [i for i, m in head.channels.sent if isinstance(m, AddRequest)]
    assert len(adds) == 1 + max_retries
    assert head.slots_in_use() == 0


async def test_a_retry_with_no_live_replica_fails_clearly_after_the_wait() -> None:
    head = Head("echo-1stage", {0: 1}, no_replica_wait_s=0.3)
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0]))
    head.out(0, 0, 0, "ab")
    start = time.monotonic()
    head.fail(0, 0)
    with pytest.raises(StageFailedError) as info:
        await collect(stream)  # bounded by collect's own 5 s: it must not hang
    waited = time.monotonic() - start
    assert 0.25 <= waited < 3
    message = str(info.value)
    assert "replica 0 went ERROR: local process exited" in message
    assert "has no live replica" in message
    assert head.slots_in_use() == 0


async def test_closing_the_stream_while_a_retry_waits_cancels_the_wait() -> None:
    head = Head("echo-1stage", {0: 1}, no_replica_wait_s=30.0)
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0]))
    head.fail(0, 0)
    head.channels.take()
    await ticks()
    stream.close()
    await ticks()
    head.up(0, 1)  # a replica appearing later gets nothing for the closed request
    await ticks()
    assert not [m for _, m in head.channels.take() if isinstance(m, AddRequest | OutputChunk)]
    assert head.orch.in_flight == 0
    assert head.slots_in_use() == 0


# -- replica to replica (the connector seam) ---------------------------------------------


async def test_hidden_stages_send_straight_to_the_next_replica() -> None:
    head = Head("echo", {0: 1, 1: 1, 2: 1}, peers=True)
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [2]))
    # thinker -> talker -> vocoder: only the vocoder's output is the client's.
    assert head.channels.take() == [
        (ident(0, 0), add([], None, PROMPT, peers=["tcp://127.0.0.1:7010"], head_all=False)),
        (ident(1, 0), add([0], None, peers=["tcp://127.0.0.1:7020"], head_all=False)),
        (ident(2, 0), add([1], None)),
    ]
    # The head sees only the last chunk of each hidden stage, and forwards nothing.
    head.out(0, 0, 3, "hello", finished=True)
    head.out(1, 0, 0, "HELLO", finished=True)
    assert head.channels.take() == []
    assert head.slots_in_use() == 1  # thinker and talker slots freed by their last chunk
    head.out(2, 0, 0, "HELLO!", finished=True)
    assert [o.text for o in await collect(stream)] == ["HELLO!"]
    assert head.slots_in_use() == 0


async def test_a_lost_replica_on_a_direct_path_reruns_the_whole_path_as_a_new_attempt() -> None:
    head = Head("echo", {0: 1, 1: 2, 2: 1}, peers=True)
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [2]))
    failing = head.replica_of(1)
    other = 1 - failing
    head.out(0, 0, 3, "hello", finished=True)  # the thinker is done, its slot freed
    head.out(2, 0, 0, "HEL")  # the client already has this
    head.channels.take()
    head.fail(1, failing)
    # The talker's inputs went replica to replica, so the thinker runs again; the
    # vocoder's did too, so it runs again as well, skipping what the client has.
    talker_peer = f"tcp://127.0.0.1:{7010 + other}"
    assert head.channels.take() == [
        (ident(1, failing), Abort("r1")),
        (ident(2, 0), Abort("r1")),
        (ident(0, 0), add([], None, PROMPT, attempt=1, peers=[talker_peer], head_all=False)),
        (
            ident(1, other),
            add([0], None, attempt=1, peers=["tcp://127.0.0.1:7020"], head_all=False),
        ),
        (ident(2, 0), add([1], Resume(text="HEL", data_chunks=0, seq=1), attempt=1)),
    ]
    head.out(2, 0, 0, "HELLO!", finished=True)  # the earlier attempt's: dropped
    head.out(0, 0, 3, "hello", finished=True, attempt=1)
    head.out(1, other, 0, "HELLO", finished=True, attempt=1)
    head.out(2, 0, 1, "LO!", finished=True, attempt=1)
    assert [o.text for o in await collect(stream)] == ["HEL", "LO!"]
    assert head.slots_in_use() == 0


async def test_edges_out_of_a_final_stage_stay_with_the_head() -> None:
    # voice-like: the thinker's text is the client's, so the head forwards it.
    head = Head("echo", {0: 1, 1: 1, 2: 1}, peers=True)
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0, 2]))
    adds = [m for _, m in head.channels.take() if isinstance(m, AddRequest)]
    assert [(a.peers, a.head_all, a.peer_tensors) for a in adds] == [
        ([], True, False),
        (["tcp://127.0.0.1:7020"], False, False),
        ([], True, False),
    ]
    stream.close()


def omni_like(replicas: dict[int, int]) -> Head:
    """echo with thinker -> talker a tensor edge (an ``omni_kv_config`` entry), as in a
    Qwen2.5-Omni pipeline."""
    head = Head("echo", replicas, peers=True)
    head.orch.graph.tensor_edges = frozenset({(0, 1)})
    return head


async def test_a_final_stage_sends_its_tensors_straight_on_and_feeds_a_new_talker() -> None:
    # The thinker's text is the client's, its tensors the talker's only.
    head = omni_like({0: 1, 1: 2, 2: 1})
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0, 2]))
    failing = head.replica_of(1)
    other = 1 - failing
    old_talker, new_talker = (f"tcp://127.0.0.1:{7010 + r}" for r in (failing, other))
    vocoder = "tcp://127.0.0.1:7020"
    assert head.channels.take() == [
        (ident(0, 0), add([], None, PROMPT, peers=[old_talker], peer_tensors=True)),
        (ident(1, failing), add([0], None, peers=[vocoder], head_all=False)),
        (ident(2, 0), add([1], None)),
    ]
    head.out(0, 0, 0, "hel")  # the client's; the talker has it from the thinker
    head.out(2, 0, 0, "HEL")
    assert head.channels.take() == []
    head.fail(1, failing)
    # The thinker keeps running and feeds the new talker again what it kept; the
    # vocoder's inputs came from the lost talker, so it runs again, skipping what the
    # client has.
    assert head.channels.take() == [
        (ident(1, failing), Abort("r1")),
        (ident(2, 0), Abort("r1")),
        (ident(1, other), add([0], None, attempt=1, peers=[vocoder], head_all=False)),
        (ident(2, 0), add([1], Resume(text="HEL", data_chunks=0, seq=1), attempt=1)),
        (ident(0, 0), Redirect("r1", 1, [new_talker], [PeerConnector("zmq")], [old_talker])),
    ]
    head.out(0, 0, 1, "lo", finished=True)  # its own attempt goes on
    head.out(1, other, 0, "HELLO", finished=True, attempt=1)
    assert head.channels.take() == []
    head.out(2, 0, 1, "LO!", finished=True, attempt=1)
    assert [o.text for o in await collect(stream)] == ["hel", "HEL", "lo", "LO!"]
    # The request is over: the thinker drops what it kept.
    assert head.channels.take() == [(ident(0, 0), Abort("r1"))]
    assert (head.orch.redirects_total, head.orch.retried_total) == (1, 1)
    assert head.orch.forwarded_tensor_chunks_total == 0
    assert head.slots_in_use() == 0


async def test_a_lost_keeper_runs_again_with_all_it_fed_resuming_its_text() -> None:
    head = omni_like({0: 2, 1: 1, 2: 1})
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0, 2]))
    failing = head.replica_of(0)
    head.out(0, failing, 0, "hel")
    head.channels.take()
    head.fail(0, failing)
    sent = head.channels.take()
    adds = {i: m for i, m in sent if isinstance(m, AddRequest)}
    # The client has its text: the thinker resumes after it (as any final stage); the
    # talker and vocoder start over from the thinker's tensors, all sent again.
    assert adds[ident(0, 1 - failing)].resume == Resume(text="hel", data_chunks=0, seq=1)
    assert adds[ident(0, 1 - failing)].peer_tensors
    assert adds[ident(1, 0)].resume is None and adds[ident(1, 0)].attempt == 1
    assert not any(isinstance(m, Redirect) for _, m in sent)
    stream.close()


async def test_a_talker_whose_keeper_is_gone_runs_the_keeper_again_resuming() -> None:
    head = omni_like({0: 2, 1: 2, 2: 1})
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0, 2]))
    lost_thinker, lost_talker = head.replica_of(0), head.replica_of(1)
    head.out(0, lost_thinker, 0, "hello", finished=True)  # done: its slot is freed
    head.fail(0, lost_thinker)  # and then its replica is lost: what it kept went with it
    head.channels.take()
    head.fail(1, lost_talker)
    adds = {i: m for i, m in head.channels.take() if isinstance(m, AddRequest)}
    # The thinker runs again on its other replica, feeding the new talker every tensor;
    # the client has its text, which the rerun skips.
    thinker = adds[ident(0, 1 - lost_thinker)]
    assert thinker.resume == Resume(text="hello", data_chunks=0, seq=1)
    assert thinker.peer_tensors and thinker.attempt == 1
    assert adds[ident(1, 1 - lost_talker)].resume is None
    head.out(0, 1 - lost_thinker, 1, "", finished=True, attempt=1)
    head.out(1, 1 - lost_talker, 0, "HELLO", finished=True, attempt=1)
    head.out(2, 0, 0, "HELLO!", finished=True, attempt=1)
    # The thinker's text and end reached the client once.
    got = [(o.stage_id, o.text, o.finished) for o in await collect(stream)]
    assert got == [(0, "hello", True), (2, "HELLO!", True)]
    assert head.slots_in_use() == 0


async def test_a_keeper_that_kept_nothing_runs_again_to_feed_the_new_talker() -> None:
    head = omni_like({0: 1, 1: 2, 2: 1})
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0, 2]))
    failing = head.replica_of(1)
    head.out(0, 0, 0, "hello", finished=True)
    head.out(2, 0, 0, "HEL")
    head.fail(1, failing)
    (redirect,) = [m for _, m in head.channels.take() if isinstance(m, Redirect)]
    # Its replica dropped what it kept: it says so, stamped with the redirect's attempt.
    stale = OutputChunk("r1", 0, 0, 1, 0, "text", error="nothing kept", attempt=0)
    stale.error_kind = ErrorKind.NOT_KEPT
    head.orch.on_outputs([stale])  # not this redirect's: ignored
    assert head.channels.take() == []
    head.orch.on_outputs([msgspec.structs.replace(stale, attempt=redirect.attempt)])
    sent = head.channels.take()
    adds = {i: m for i, m in sent if isinstance(m, AddRequest)}
    # Thinker, talker and vocoder run again as a new attempt; the thinker resumes after
    # the text the client has, the vocoder after its audio; no retry is spent on it.
    assert adds[ident(0, 0)].resume == Resume(text="hello", data_chunks=0, seq=1)
    assert adds[ident(0, 0)].attempt == 2 == adds[ident(1, 1 - failing)].attempt
    assert adds[ident(2, 0)].resume == Resume(text="HEL", data_chunks=0, seq=1)
    assert not any(isinstance(m, Redirect) for _, m in sent)
    assert head.orch.retried_total == 1
    head.orch.on_outputs([msgspec.structs.replace(stale, attempt=redirect.attempt)])  # again
    assert head.channels.take() == []
    head.out(0, 0, 1, "", finished=True, attempt=2)
    head.out(1, 1 - failing, 0, "HELLO", finished=True, attempt=2)
    head.out(2, 0, 1, "LO!", finished=True, attempt=2)
    got = [(o.stage_id, o.text) for o in await collect(stream)]
    assert got == [(0, "hello"), (2, "HEL"), (2, "LO!")]
    assert head.slots_in_use() == 0


async def test_tensor_chunks_the_head_passes_on_are_counted() -> None:
    head = Head("echo", {0: 1, 1: 1, 2: 1})  # no peer listeners: every edge via the head
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0, 2]))
    head.channels.take()
    head.orch.on_outputs([OutputChunk("r1", 0, 0, 1, 0, "tensor", data=b"abcd")])
    assert [type(m) for _, m in head.channels.take()] == [OutputChunk]
    assert head.orch.forwarded_tensor_chunks_total == 1
    assert head.orch.forwarded_tensor_bytes_total == 4
    stream.close()


async def test_a_busy_refusal_is_dispatched_again_elsewhere_without_spending_a_retry() -> None:
    # Several heads share the replicas: replica 0 refused as full with other heads' work.
    head = Head("echo-1stage", {0: 2}, max_retries=0)
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0]))
    first = head.replica_of(0)
    head.channels.take()
    head.out(0, first, 0, "", finished=True, error="full", error_kind="busy")
    await until(lambda: any(isinstance(m, AddRequest) for _, m in head.channels.sent))
    second = head.replica_of(0)
    assert second != first  # it looks full until its next heartbeat says otherwise
    assert head.pools[0].replicas[first].others == head.pools[0].replicas[first].capacity
    (add_msg,) = [m for _, m in head.channels.take() if isinstance(m, AddRequest)]
    assert add_msg.attempt == 1
    assert add_msg.resume is not None and add_msg.resume.seq == 1  # after the refusal
    head.out(0, second, 1, "hi [echo]", finished=True, attempt=1)
    chunks = await collect(stream)
    assert "".join(c.text for c in chunks) == "hi [echo]"
    assert (head.orch.retried_total, head.orch.busy_total) == (0, 1)
    assert head.slots_in_use() == 0


async def test_a_stage_refused_busy_without_end_fails_as_overloaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("omnistage.dataplane.failover.MAX_BUSY", 3)
    monkeypatch.setattr("omnistage.dataplane.failover.BUSY_PAUSE_S", 0.001)
    head = Head("echo-1stage", {0: 1})
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0]))
    for attempt in range(4):
        await until(lambda: "r1" in head.pools[0].replicas[0].requests)
        seq = attempt  # each refusal took one number
        head.out(0, 0, seq, "", finished=True, error="full", error_kind="busy", attempt=attempt)
    with pytest.raises(StageOverloadedError):
        await collect(stream)
    assert head.orch.busy_total == 4
    assert head.slots_in_use() == 0
