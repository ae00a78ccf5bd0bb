"""The replica's heartbeat thread against a coordinator ROUTER in this process: what each
beat carries, how acks decide the head is lost, and the DOWN goodbye."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from omnistage.control.master import HeadAddresses, Master
from omnistage.control.slots import SlotTable
from omnistage.protocol import codec
from omnistage.protocol.auth import Signer, Verifier
from omnistage.protocol.messages import (
    HandshakeInit,
    HeadProbe,
    HeadProbeReply,
    Heartbeat,
    HeartbeatAck,
    ReplicaState,
)
from omnistage.protocol.registration import RegisterReply
from omnistage.replica.heartbeat import (
    FULL_EVERY,
    HeartbeatSpec,
    HeartbeatThread,
    LoadReport,
    Reports,
)
from tests.unit.test_replica_register import FakeRouter


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)  # a failed test may leave a socket open


class Coordinator:
    """Answers each heartbeat with ``state`` (None: stays silent); records them."""

    def __init__(self, ctx: zmq.Context, state: ReplicaState | None, token: str | None = None):
        self.state = state
        self.beats: list[Heartbeat] = []
        self.got = threading.Condition()
        self._verifier = Verifier(token) if token else None
        self._signer = Signer(token) if token else None
        self.router = FakeRouter(ctx, self._answer)
        self.address = f"tcp://127.0.0.1:{self.router.port}"

    def _answer(self, frames: list[bytes]) -> list[bytes] | None:
        message, stamp = codec.split_signed(frames[1:])
        codec.check_signed(message, stamp, self._verifier)
        beat = codec.decode_frames(message)
        with self.got:
            self.beats.append(beat)
            self.got.notify_all()
        if self.state is None or beat.status == ReplicaState.DOWN:
            return None
        ack = HeartbeatAck(state=self.state, head_instance="head-a")
        return [frames[0], *codec.sign(codec.encode(ack), self._signer)]

    def wait_for(self, count: int) -> list[Heartbeat]:
        return self.wait_until(lambda beats: len(beats) >= count)

    def wait_until(self, done: Callable[[list[Heartbeat]], bool]) -> list[Heartbeat]:
        with self.got:
            assert self.got.wait_for(lambda: done(self.beats), timeout=5)
            return list(self.beats)


def _spec(address: str, lost_after_s: float = 10.0) -> HeartbeatSpec:
    return HeartbeatSpec(address, 2, 5, 9, interval_s=0.02, lost_after_s=lost_after_s)


def test_spec_of_a_registration_takes_the_coordinator_and_interval() -> None:
    reply = RegisterReply("tcp://h:1", "tcp://h:2", "tcp://h:3", 4, None, stage_id=1, epoch=8)
    init = HandshakeInit({}, "tcp://h:2", "tcp://h:3", "tcp://h:9", 0.5, 10.0)
    spec = HeartbeatSpec.of(1, reply, init, lost_after_s=3.0)
    assert spec == HeartbeatSpec("tcp://h:9", 1, 4, 8, 0.5, 3.0)


def test_beats_carry_the_load_and_a_detail_only_while_starting(ctx: zmq.Context) -> None:
    head = Coordinator(ctx, ReplicaState.STARTING, token="t")
    status = [ReplicaState.STARTING]
    reports = Reports(
        load=lambda: LoadReport(queue_length=3, in_flight=2, progress=11),
        status=lambda: status[0],
        detail=lambda: "loading weights",
    )
    beats = HeartbeatThread(ctx, _spec(head.address), reports, signer=Signer("t"))
    beats.start()
    try:
        first = head.wait_for(1)[0]
        status[0] = ReplicaState.UP
        later = head.wait_for(len(head.beats) + 2)[-1]
    finally:
        beats.stop()
        head.router.close()
    assert (first.stage_id, first.replica_id, first.epoch) == (2, 5, 9)
    assert (first.queue_length, first.in_flight, first.progress) == (3, 2, 11)
    assert first.status == ReplicaState.STARTING and first.detail == "loading weights"
    assert later.status == ReplicaState.UP and later.detail == ""
    assert later.seq > first.seq
    assert beats.head_instance == "head-a"


def test_stop_says_down_last(ctx: zmq.Context) -> None:
    head = Coordinator(ctx, ReplicaState.UP)
    beats = HeartbeatThread(ctx, _spec(head.address), Reports(load=lambda: LoadReport(0, 0, 0)))
    beats.start()
    try:
        head.wait_for(1)
        beats.stop(send_down=True)
        got = head.wait_until(lambda b: b[-1].status == ReplicaState.DOWN)
    finally:
        head.router.close()
    assert all(b.status == ReplicaState.UP for b in got[:-1])


def test_a_failing_load_report_still_beats(ctx: zmq.Context) -> None:
    head = Coordinator(ctx, ReplicaState.UP)

    def broken() -> LoadReport:
        raise RuntimeError("engine busy")

    beats = HeartbeatThread(ctx, _spec(head.address), Reports(load=broken))
    beats.start()
    try:
        beat = head.wait_for(1)[0]
    finally:
        beats.stop(send_down=False)
        head.router.close()
    assert (beat.queue_length, beat.in_flight, beat.progress) == (0, 0, 0)


@pytest.mark.parametrize(
    ("state", "failed", "why"),
    [
        (ReplicaState.UNKNOWN, False, "does not know this replica"),
        (ReplicaState.ERROR, True, "marked this replica ERROR"),
        (None, False, "no answer from the head"),
    ],
)
def test_the_head_is_lost_once(
    ctx: zmq.Context, state: ReplicaState | None, failed: bool, why: str
) -> None:
    head = Coordinator(ctx, state)
    lost: list[tuple[str, bool]] = []
    called = threading.Event()

    def on_lost(reason: str, was_failed: bool) -> None:
        lost.append((reason, was_failed))
        called.set()

    spec = _spec(head.address, lost_after_s=0.1)
    beats = HeartbeatThread(ctx, spec, Reports(load=lambda: LoadReport(0, 0, 0)), on_lost=on_lost)
    beats.start()
    try:
        assert called.wait(5)
        head.wait_for(len(head.beats) + 3)  # it keeps beating, and says so only once
    finally:
        beats.stop(send_down=False)
        head.router.close()
    assert len(lost) == 1
    assert why in lost[0][0] and lost[0][1] is failed


def _master_of(instance: str) -> Master:
    """A real master (token "t") of a head with ``instance`` id."""
    addresses = HeadAddresses("tcp://a:1", "tcp://a:2", "tcp://a:3", "tcp://a:4")
    return Master(
        SlotTable([2], instance=instance),
        addresses,
        lambda slot, req: None,
        threading.Lock(),
        Verifier("t"),
        Signer("t"),
    )


def _master(ctx: zmq.Context, instance: str) -> FakeRouter:
    """That master on loopback."""
    return FakeRouter(ctx, _master_of(instance).handle)


@pytest.mark.parametrize(("instance", "lost"), [("head-b", True), ("head-a", False)])
def test_silent_acks_ask_the_master_which_head_is_there(
    ctx: zmq.Context, instance: str, lost: bool
) -> None:
    # The coordinator we registered with is gone (no acks); the master's address now
    # answers as ``instance``. A new head: register again at once, long before
    # lost_after_s. The same head (only slow to ack): keep waiting.
    silent = Coordinator(ctx, None, token="t")
    master = _master(ctx, instance)
    gone = threading.Event()
    why: list[str] = []
    spec = HeartbeatSpec(
        silent.address,
        2,
        5,
        9,
        interval_s=0.05,
        lost_after_s=30.0,
        master=f"tcp://127.0.0.1:{master.port}",
        head_instance="head-a",
    )

    def on_lost(reason: str, failed: bool) -> None:
        why.append(reason)
        gone.set()

    beats = HeartbeatThread(
        ctx,
        spec,
        Reports(load=lambda: LoadReport(0, 0, 0)),
        signer=Signer("t"),
        verifier=Verifier("t"),
        on_lost=on_lost,
    )
    beats.start()
    try:
        if lost:
            assert gone.wait(5)
            assert why == ["a new head answers at the master (the head restarted)"]
        else:
            deadline = time.monotonic() + 5
            while len(master.received) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(master.received) >= 4, "several probes answered"
            assert not gone.is_set()
    finally:
        beats.stop(send_down=False)
        silent.router.close()
        master.close()


def test_answered_acks_send_no_probes(ctx: zmq.Context) -> None:
    head = Coordinator(ctx, ReplicaState.UP)
    master = _master(ctx, "head-b")
    spec = HeartbeatSpec(
        head.address, 2, 5, 9, 0.02, 30.0, f"tcp://127.0.0.1:{master.port}", "head-a"
    )
    beats = HeartbeatThread(ctx, spec, Reports(load=lambda: LoadReport(0, 0, 0)))
    beats.start()
    try:
        head.wait_for(10)
    finally:
        beats.stop(send_down=False)
        head.router.close()
        master.close()
    assert master.received == []


def test_the_master_answers_only_signed_probes_with_its_instance(ctx: zmq.Context) -> None:
    master = _master_of("head-b")
    probe = codec.encode(HeadProbe(stage_id=2, replica_id=5))
    assert master.handle([b"peer", *probe]) is None  # unsigned: dropped
    assert master.handle([b"peer", *codec.sign(probe, Signer("other"))]) is None
    reply = master.handle([b"peer", *codec.sign(probe, Signer("t"))])
    assert reply is not None and reply[0] == b"peer"
    answer = codec.decode_signed(reply[1:], Verifier("t"), HeadProbeReply)
    assert answer.head_instance == "head-b"


def test_a_forged_ack_is_ignored(ctx: zmq.Context) -> None:
    # The head signs with another token: its UNKNOWN must not make the replica leave.
    head = Coordinator(ctx, ReplicaState.UNKNOWN, token="other")
    head._verifier = None  # it accepts our beats; our verifier refuses its acks
    lost = threading.Event()
    beats = HeartbeatThread(
        ctx,
        _spec(head.address),
        Reports(load=lambda: LoadReport(0, 0, 0)),
        signer=Signer("t"),
        verifier=Verifier("t"),
        on_lost=lambda why, failed: lost.set(),
    )
    beats.start()
    try:
        head.wait_for(4)
    finally:
        beats.stop(send_down=False)
        head.router.close()
    assert not lost.is_set() and beats.head_instance == ""


def _carrying(beats: list[Heartbeat]) -> list[Heartbeat]:
    return [b for b in beats if b.cached_prefixes is not None]


def test_cached_prefixes_go_out_first_when_changed_and_every_few_beats(
    ctx: zmq.Context,
) -> None:
    head = Coordinator(ctx, ReplicaState.UP)
    snapshot = [(1, (11, 12))]
    reports = Reports(load=lambda: LoadReport(0, 0, 0), cached_prefixes=lambda: snapshot[0])
    beats = HeartbeatThread(ctx, _spec(head.address), reports)
    beats.start()
    try:
        # Unchanged: the first beat (a new registration) and every FULL_EVERY-th after.
        steady = head.wait_until(lambda b: len(_carrying(b)) >= 3)
        carried = _carrying(steady)
        snapshot[0] = (2, (13,))
        changed_at = head.beats[-1].seq
        got = head.wait_until(lambda b: b[-1].cached_prefixes == [13])
        beats.stop(send_down=True)
        got = head.wait_until(lambda b: b[-1].status == ReplicaState.DOWN)
    finally:
        head.router.close()
    assert steady[0].seq == 1 and steady[0].cached_prefixes == [11, 12]
    assert [b.seq for b in carried] == [1, 1 + FULL_EVERY, 1 + 2 * FULL_EVERY]
    assert all(b.cached_prefixes == [11, 12] for b in carried)
    # A change goes out with the next beats, not at the next periodic one.
    first_new = next(b for b in got if b.cached_prefixes == [13])
    assert first_new.seq - changed_at < FULL_EVERY // 2
    assert not any(b.cached_prefixes == [11, 12] for b in got if b.seq > first_new.seq)
    assert got[-1].cached_prefixes is None  # the goodbye carries none


def test_an_engine_without_a_prefix_cache_or_a_failing_report_sends_none(
    ctx: zmq.Context,
) -> None:
    def broken() -> tuple[int, tuple[int, ...]] | None:
        raise RuntimeError("engine busy")

    for report in (lambda: None, broken):
        head = Coordinator(ctx, ReplicaState.UP)
        reports = Reports(load=lambda: LoadReport(1, 0, 0), cached_prefixes=report)
        beats = HeartbeatThread(ctx, _spec(head.address), reports)
        beats.start()
        try:
            got = head.wait_for(FULL_EVERY + 2)
        finally:
            beats.stop(send_down=False)
            head.router.close()
        assert all(b.cached_prefixes is None and b.queue_length == 1 for b in got)


def test_a_new_registration_sends_the_keys_at_once(ctx: zmq.Context) -> None:
    # Each registration (a rejoin after the head restarted) beats from a new thread,
    # whose first beat carries the whole set, however old its version.
    head = Coordinator(ctx, ReplicaState.UP)
    reports = Reports(load=lambda: LoadReport(0, 0, 0), cached_prefixes=lambda: (5, (1, 2, 3)))
    for _ in range(2):
        since = len(head.beats)  # a late beat of the last thread may still come
        beats = HeartbeatThread(ctx, _spec(head.address), reports)
        beats.start()
        try:
            got = head.wait_until(lambda b: any(x.seq == 1 for x in b[since:]))  # noqa: B023
        finally:
            beats.stop(send_down=False)
        first = next(x for x in got[since:] if x.seq == 1)
        assert first.cached_prefixes == [1, 2, 3]
    head.router.close()


def test_a_head_whose_connection_closed_is_lost_long_before_the_silence_timeout(
    ctx: zmq.Context,
) -> None:
    # The head's process died: its coordinator's socket is closed, so is our connection.
    head = Coordinator(ctx, ReplicaState.UP)
    gone = threading.Event()
    why: list[str] = []

    def on_lost(reason: str, failed: bool) -> None:
        why.append(reason)
        gone.set()

    spec = HeartbeatSpec(head.address, 2, 5, 9, interval_s=0.05, lost_after_s=30.0)
    beats = HeartbeatThread(ctx, spec, Reports(load=lambda: LoadReport(0, 0, 0)), on_lost=on_lost)
    beats.start()
    try:
        head.wait_for(3)
        assert not gone.is_set()
        closed = time.monotonic()
        head.router.close()
        assert gone.wait(5)
        assert time.monotonic() - closed < 5
        assert len(why) == 1 and "closed its connection" in why[0]
    finally:
        beats.stop(send_down=False)


def test_the_fleets_heads_in_acks_are_told_once_per_change(ctx: zmq.Context) -> None:
    head = Coordinator(ctx, ReplicaState.UP)
    lists = [["tcp://a:1", "tcp://b:1"]]
    original = head._answer

    def answer(frames: list[bytes]) -> list[bytes] | None:
        reply = original(frames)
        if reply is None:
            return None
        ack = codec.decode_frames(reply[1:])
        ack.heads = lists[-1]
        return [reply[0], *codec.encode(ack)]

    head.router._answer = answer
    told: list[list[str]] = []
    beats = HeartbeatThread(
        ctx,
        _spec(head.address),
        Reports(load=lambda: LoadReport(0, 0, 0)),
        on_heads=told.append,
    )
    beats.start()
    try:
        head.wait_for(5)
        lists.append(["tcp://a:1", "tcp://b:1", "tcp://c:1"])
        head.wait_for(len(head.beats) + 5)
    finally:
        beats.stop(send_down=False)
        head.router.close()
    assert told == lists
