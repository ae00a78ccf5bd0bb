"""Pure parts of the head and replica roles: the start-up watch, dial-in bookkeeping,
the replica options blob, and which edges of a request go replica to replica."""

from __future__ import annotations

import pytest

from omnistage.config.load import load_config
from omnistage.dataplane.graph import StageGraph
from omnistage.dataplane.run import Run, direct_edge, redirects, restart_group
from omnistage.dataplane.stage_pool import ReplicaHandle
from omnistage.head.events import DialIns
from omnistage.head.options import HeadOptions
from omnistage.head.startup import StartupWatch, Verdict
from omnistage.protocol.messages import Prompt
from omnistage.replica.options import ReplicaOptions, decode_options, encode_options
from tests.unit.fakes import FakeClock


def test_startup_watch_notes_while_waiting_and_fails_after_the_init_timeout() -> None:
    clock = FakeClock(1000.0)
    watch = StartupWatch(clock, init_timeout_s=30, note_every_s=10)
    missing = [(1, "talker")]
    assert watch.judge(missing) is Verdict.WAITING
    clock.now += 10.5
    assert watch.judge(missing) is Verdict.NOTE
    assert watch.judge(missing) is Verdict.WAITING  # one note per interval
    clock.now += 20
    assert watch.judge(missing) is Verdict.FAILED
    assert watch.judge([]) is Verdict.SERVING


def test_dial_ins_hand_back_the_endpoints_they_replace() -> None:
    dials = DialIns()
    urls = ("tcp://h:1", "tcp://h:2", "tcp://h:3")
    assert dials.replace((0, 1), urls) is None
    assert dials.get((0, 1)) == urls
    # The slot re-registers without binding its own sockets: the old ones come back.
    assert dials.replace((0, 1), None) == urls
    assert dials.get((0, 1)) is None


def test_replica_options_travel_as_one_blob_with_their_secrets() -> None:
    opts = ReplicaOptions(
        stage_id=2,
        master_host="10.0.0.1",
        master_port=25000,
        stage_overrides={"devices": "1"},
        auth_token="s3cret",
        local_key="k",
        rejoin=True,
    )
    assert decode_options(encode_options(opts)) == opts


def test_the_heads_own_replicas_get_its_key_and_a_dialable_master() -> None:
    opts = HeadOptions(config=load_config("echo"), master_host="0.0.0.0", auth_token="t")
    replica = opts.local_replica(1, 0, 25000, "key")
    assert (replica.master_host, replica.master_port) == ("127.0.0.1", 25000)
    assert (replica.local_key, replica.auth_token, replica.rejoin) == ("key", "t", False)
    assert opts.local_replicas() == {0: 1, 1: 1, 2: 1}


def _run(finals: set[int], peers: dict[int, str], address: str = "127.0.0.1") -> Run:
    run = Run("r", Prompt(text="x"), {}, {0, 1, 2}, finals)
    for sid in (0, 1, 2):
        handle = ReplicaHandle(sid, 0, 1, b"", 4, address=address, peer_address=peers.get(sid, ""))
        run.assigned[sid] = handle
    return run


@pytest.mark.parametrize(
    ("finals", "peers", "address", "expected"),
    [
        ({2}, {1: "tcp://127.0.0.1:9"}, "127.0.0.1", True),
        ({0, 2}, {1: "tcp://127.0.0.1:9"}, "127.0.0.1", False),  # the head needs 0's text
        ({2}, {}, "127.0.0.1", False),  # the receiver takes inputs only via the head
        ({2}, {1: "tcp://10.0.0.2:9"}, "10.0.0.3", True),
        ({2}, {1: "tcp://127.0.0.1:9"}, "10.0.0.3", False),  # loopback from another host
    ],
)
def test_direct_edges(
    finals: set[int], peers: dict[int, str], address: str, expected: bool
) -> None:
    graph = StageGraph(load_config("echo"))
    assert direct_edge(graph, _run(finals, peers, address), 0, 1) is expected


def test_a_tensor_edge_out_of_a_final_stage_is_direct() -> None:
    graph = StageGraph(load_config("echo"))
    graph.tensor_edges = frozenset({(0, 1)})  # as an omni_kv_config entry names it
    run = _run({0, 2}, {1: "tcp://127.0.0.1:9", 2: "tcp://127.0.0.1:8"})
    assert direct_edge(graph, run, 0, 1)  # the head gets 0's text, 1 its tensors
    assert direct_edge(graph, run, 1, 2)


def test_a_restart_takes_every_stage_joined_by_direct_edges() -> None:
    run = _run({2}, {})
    run.direct = {(0, 1)}
    assert restart_group(run, 1) == {0, 1}
    assert restart_group(run, 0) == {0, 1}
    assert restart_group(run, 2) == {2}  # its input came through the head
    run.direct = {(0, 1), (1, 2)}
    assert restart_group(run, 2) == {0, 1, 2}


def test_a_keeper_upstream_is_not_restarted_but_feeds_the_new_replicas() -> None:
    # thinker (0, final, keeps what it sent) -> talker (1) -> token2wav (2, final)
    run = _run({0, 2}, {1: "tcp://h:1", 2: "tcp://h:2"})
    run.direct, run.keepers = {(0, 1), (1, 2)}, {0}
    assert restart_group(run, 1) == {1, 2}
    assert restart_group(run, 2) == {1, 2}  # the talker's codes are gone with it: it reruns
    assert restart_group(run, 0) == {0, 1, 2}  # the keeper itself lost: all run again
    assert redirects(run, {1, 2}) == {0: {1: "tcp://h:1"}}
    assert redirects(run, {0, 1, 2}) == {}
    run.keepers = set()  # a replica that keeps nothing: as before
    assert restart_group(run, 1) == {0, 1, 2}
    assert redirects(run, {0, 1, 2}) == {}
