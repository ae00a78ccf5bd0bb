"""The head's replica bookkeeping, built once and shared by the roles that need it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from omnistage.control.coordinator import Coordinator, PrefixReport
from omnistage.control.replica_table import ReplicaTable, Transition
from omnistage.control.slots import SlotTable
from omnistage.head.options import HeadOptions


@dataclass(frozen=True)
class ControlState:
    """The head's replica bookkeeping, shared by the control thread, the loop and the
    launcher threads: the slot table (read and written under ``lock``) and the
    coordinator (which takes the same lock for its replica table)."""

    lock: threading.Lock
    slots: SlotTable
    coordinator: Coordinator


def control_state(
    opts: HeadOptions,
    instance: str,
    local_key: str,
    on_transition: Callable[[Transition], None],
    on_prefixes: Callable[[PrefixReport], None] | None = None,
    heads: Callable[[], list[str]] | None = None,
) -> ControlState:
    """The slot table (the head's own replicas' slots pre-allocated and keyed by
    ``local_key``) and the coordinator over a fresh replica table; ``on_prefixes`` gets
    the prefix cache reports heartbeats carry (from the control thread); ``heads`` the
    fleet's heads, which every heartbeat ack tells the replica."""
    lock = threading.Lock()
    local = opts.local_replicas()
    slots = SlotTable(
        opts.config.stage_ids,
        preallocated=local,
        head_local={sid: list(range(n)) for sid, n in local.items()},
        instance=instance,
        # Epochs start at the head's start time: a later head's registrations fence
        # off an earlier one's.
        epoch_base=int(time.time() * 1000),
        local_key=local_key,
    )
    table = ReplicaTable(time.monotonic, opts.heartbeat_timeout_s, opts.stall_timeout_s)
    coordinator = Coordinator(
        table,
        lock,
        on_transition,
        opts.verifier(),
        opts.signer(),
        head_instance=instance,
        on_prefixes=on_prefixes,
        heads=heads,
    )
    return ControlState(lock, slots, coordinator)
