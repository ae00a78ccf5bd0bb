"""The head's parts built from its options: the factories ``Head.__init__`` calls."""

from __future__ import annotations

import time
from collections.abc import Callable

from omnistage.control.balancing import make_policy
from omnistage.control.coordinator import Coordinator
from omnistage.control.handshake import HandshakeServer
from omnistage.control.head_peers import FleetView
from omnistage.control.master import Master
from omnistage.control.plane import ControlPlane
from omnistage.dataplane.graph import StageGraph
from omnistage.dataplane.orchestrator import Orchestrator
from omnistage.dataplane.stage_pool import StagePool
from omnistage.head.events import ReplicaEvents
from omnistage.head.gossip import HeadFleet
from omnistage.head.local import LocalReplicas
from omnistage.head.options import HeadOptions
from omnistage.head.scaler import Scaler
from omnistage.head.sockets import HeadSockets
from omnistage.head.state import ControlState
from omnistage.net import detect_local_address, split_tcp_url, tcp_url


def orchestrator(opts: HeadOptions, sockets: HeadSockets) -> Orchestrator:
    """The orchestrator over one stage pool per stage, each with its balancing policy
    (the stage's ``lb_policy``, else --omni-lb-policy)."""
    pools = {
        s.stage_id: StagePool(
            s.stage_id, s.name, make_policy(s.lb_policy or opts.lb_policy), opts.max_queue
        )
        for s in opts.config.stages
    }
    return Orchestrator(
        StageGraph(opts.config),
        pools,
        sockets.channels,
        no_replica_wait_s=opts.no_replica_wait_s,
        max_retries=opts.max_retries,
        restart_wait_s=opts.restart_wait_s,
    )


def control_plane(
    opts: HeadOptions,
    state: ControlState,
    sockets: HeadSockets,
    events: ReplicaEvents,
    fleet: HeadFleet,
) -> tuple[Master, ControlPlane]:
    """The master (answering other heads' announcements too), handshake and coordinator
    on the control thread's sockets."""
    master = Master(
        state.slots,
        sockets.addresses,
        events.on_register,
        state.lock,
        opts.verifier(),
        opts.signer(),
        announce=fleet.answer,
        on_moved=events.on_moved,
        id_owner=fleet.id_owner,
    )
    handshake = HandshakeServer(state.slots, state.lock, events.init_for, opts.verifier())
    control = ControlPlane(state.coordinator.tick)
    # Registrations and handshakes a few at a time between rounds of heartbeats: in a
    # storm of thousands of replicas registering at once, beats queued behind hundreds
    # of registrations aged past the timeout and healthy replicas were marked ERROR.
    control.add(sockets.master, master.handle, batch=32)
    control.add(sockets.handshake, handshake.handle, batch=32)
    control.add(sockets.coordinator, state.coordinator.handle)
    return master, control


def fleet(opts: HeadOptions, master_url: str, instance: str) -> HeadFleet:
    """This head's view of its fleet: it announces itself at ``master_url`` (a
    wildcard bind host replaced by this host's address) and joins --omni-join."""
    host, port = split_tcp_url(master_url)
    if host in ("0.0.0.0", "::", "*", ""):
        # Any host the kernel routes from: the join target's route, else the default one
        # (a UDP connect sends nothing).
        toward = split_tcp_url(opts.join)[0] if opts.join else "192.0.2.1"
        master_url = tcp_url(detect_local_address(toward, 9), port)
    view = FleetView(master_url, instance, time.monotonic, opts.heartbeat_timeout_s)
    return HeadFleet(
        view,
        opts.heartbeat_interval_s,
        opts.join,
        signer=opts.signer(),
        verifier=opts.verifier(),
        curve_keys=opts.curve_keys,
    )


def scaler(
    opts: HeadOptions,
    orchestrator: Orchestrator,
    coordinator: Coordinator,
    local: LocalReplicas,
    backlog: Callable[[int], int],
) -> Scaler:
    """The autoscaler of the stages the head runs replicas of itself; ``backlog``: the
    jobs queued in the store for a stage."""
    local_stages = {sid for sid, n in opts.local_replicas().items() if n > 0}
    return Scaler(
        opts.config,
        local_stages,
        orchestrator.pools,
        coordinator.snapshot,
        local,
        latency=orchestrator.latency,
        backlog=backlog,
    )
