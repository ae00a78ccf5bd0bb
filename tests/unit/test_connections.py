"""The input ROUTER's connections by descriptor (``Connections``): a lost connection
names the replicas to probe, not the fleet, through descriptor reuse, events out of
order and reconnections."""

from __future__ import annotations

from omnistage.dataplane.connections import Connections
from omnistage.protocol.messages import routing_id


def _id(replica: int, epoch: int = 1) -> bytes:
    return routing_id(0, replica, epoch)


def _fleet(n: int) -> Connections:
    conns = Connections()
    for r in range(n):
        conns.seen(100 + r, _id(r), (0, r))
    return conns


def test_a_lost_connection_names_only_the_replica_seen_on_it() -> None:
    conns = _fleet(5000)
    assert conns.suspects(100 + 4321) == [_id(4321)]
    assert conns.suspects(99) == []  # never saw a READY on it: nobody


def test_a_replica_found_gone_is_forgotten() -> None:
    conns = _fleet(3)
    assert conns.placed_on(101)
    conns.forget(_id(1))
    assert conns.suspects(101) == []
    assert not conns.placed_on(101)  # its probes may stop
    assert len(conns) == 2
    conns.settled(101)  # the probes end with nothing left on it
    assert conns.suspects(7) == []


def test_a_reused_descriptor_names_both_until_its_probes_settle() -> None:
    conns = Connections()
    conns.seen(7, _id(1), (0, 1))
    # Replica 1's connection closed; a new replica's READY came in on the reused
    # descriptor before the monitor's event was read.
    conns.seen(7, _id(2), (0, 2))
    assert sorted(conns.suspects(7)) == [_id(1), _id(2)]
    conns.forget(_id(1))  # its Ping failed
    conns.settled(7)
    # Replica 2 stays reachable but is no longer placed: probed with any lost
    # connection, so its own loss is still found.
    assert conns.suspects(7) == [_id(2)]
    assert conns.suspects(8) == [_id(2)]
    conns.seen(9, _id(2), (0, 2))  # placed again by a message of its own
    assert conns.suspects(8) == []
    assert conns.suspects(9) == [_id(2)]


def test_a_replica_that_reconnected_is_probed_with_every_lost_connection() -> None:
    conns = _fleet(3)
    conns.settled(101)  # its DEALER reconnected: its old descriptor's probes found it
    assert conns.suspects(555) == [_id(1)]
    conns.forget(_id(1))  # later found gone
    assert conns.suspects(555) == []


def test_a_slots_newer_incarnation_replaces_the_older() -> None:
    conns = Connections()
    conns.seen(7, _id(1, epoch=1), (0, 1))
    conns.settled(7)  # unplaced, and never found gone (its process hung)
    conns.seen(8, _id(1, epoch=2), (0, 1))
    assert conns.suspects(7) == []
    assert conns.suspects(8) == [_id(1, epoch=2)]
    assert len(conns) == 1


def test_a_replica_seen_again_on_another_descriptor_moves() -> None:
    conns = _fleet(2)
    conns.seen(300, _id(0), (0, 0))
    assert conns.suspects(100) == []
    assert conns.suspects(300) == [_id(0)]
