"""Per-(stage, replica) registration slots: pure state, no sockets, no threads.

Rules (the seed's, kept exactly):
- allocation is idempotent: the same (stage, replica) always maps to the same slot;
- auto-assign fills the lowest pre-allocated, unfilled slot that is not reserved for
  the head's own local replicas, and only then the lowest id no slot uses yet;
- a head-local slot is never handed to an auto-assigned registration, even before the
  head's own replica has registered.
Each registration bumps a global epoch: the (stage, replica, epoch) triple names one
incarnation of a replica, so messages from a stale incarnation can be fenced off.
Epochs start from ``epoch_base`` (the head passes its start time in milliseconds), so
a restarted head never reissues an epoch the previous one used.

A replica rejoining the same head instance (``previous_head`` equals ``instance``)
gets its previous auto-assigned id back, with a new epoch, instead of a fresh id.

One rule of our own: an explicit id (an operator's ``--replica-id``, or one another head
of the fleet assigned) does not take over a slot another replica process holds while
that one may be alive (the seed's rule would let two processes share the id): it is
refused with ``IdConflict``, naming the holder. The slot is free to take once its holder
is proven dead: its incarnation fenced (the coordinator marked it ERROR: its connection
closed or its heartbeats stopped) or released (DOWN). The same process registering
again is idempotent; the head's own replicas (``local_key``) keep their slots; a seed
client, which names no process, takes the slot over as in the seed.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

from omnistage.protocol.errors import IdConflict, RegistrationError
from omnistage.protocol.registration import RegisterRequest


@dataclass
class Slot:
    stage_id: int
    replica_id: int
    head_local: bool = False
    filled: bool = False
    epoch: int = 0
    # What the replica told us at registration (seed keys), kept for display and checks.
    stage_config: Any = None
    bind_address: str | None = None
    binds_sockets: bool = False
    replica_ports: tuple[int, int, int] | None = None
    coordinator_addresses: dict[str, str | None] = field(default_factory=dict)
    instance: str | None = None  # the replica process's (our replicas send it)
    fenced: bool = False  # the coordinator saw this incarnation die (``fence``)


class SlotTable:
    def __init__(
        self,
        stage_ids: list[int],
        preallocated: dict[int, int] | None = None,
        head_local: dict[int, list[int]] | None = None,
        instance: str = "",
        epoch_base: int = 0,
        local_key: str | None = None,
    ) -> None:
        self._local_key = local_key
        self._stage_ids = set(stage_ids)
        self._slots: dict[tuple[int, int], Slot] = {}
        # Auto-assignment without scanning every slot (a registration storm of thousands
        # of replicas made that the head's control thread's main cost, under the lock the
        # heartbeats need): per stage, a heap of ids whose slot may be vacant (checked
        # when popped; a slot that becomes vacant is pushed again) and the lowest id no
        # slot has (slots are never removed, so it only grows).
        self._maybe_vacant: dict[int, list[int]] = {sid: [] for sid in stage_ids}
        self._lowest_unused: dict[int, int] = {sid: 0 for sid in stage_ids}
        self.instance = instance
        self._epoch = epoch_base
        # (stage, replica process instance) -> the id it registered under last.
        self._by_instance: dict[tuple[int, str], int] = {}
        local = {(sid, rid) for sid, rids in (head_local or {}).items() for rid in rids}
        for sid, count in (preallocated or {}).items():
            if count < 0:
                raise ValueError(f"preallocated[{sid}] must be >= 0, got {count}")
            for rid in range(count):
                self._add(Slot(sid, rid, head_local=(sid, rid) in local))
        for sid, rid in local:
            if (sid, rid) not in self._slots:
                self._add(Slot(sid, rid, head_local=True))

    @property
    def stage_ids(self) -> set[int]:
        return set(self._stage_ids)

    def get(self, stage_id: int, replica_id: int) -> Slot | None:
        return self._slots.get((stage_id, replica_id))

    def slots(self) -> list[Slot]:
        return [self._slots[k] for k in sorted(self._slots)]

    def register(self, req: RegisterRequest) -> Slot:
        """Fill (or refill) a slot for ``req`` and return it with a fresh epoch."""
        if req.stage_id not in self._stage_ids:
            known = ", ".join(str(s) for s in sorted(self._stage_ids))
            raise RegistrationError(f"unknown stage_id {req.stage_id} (this head serves {known})")
        # Every check comes before any change, so a refusal leaves the table untouched.
        binds = bool(req.replica_binds_sockets) and bool(req.replica_bind_address)
        ports = (req.replica_handshake_port, req.replica_input_port, req.replica_output_port)
        if binds and any(p is None or not 0 < p < 65536 for p in ports):
            raise RegistrationError(
                "replica_binds_sockets needs replica_handshake_port, replica_input_port "
                "and replica_output_port in 1..65535"
            )
        if req.replica_id < 0:
            rid = self._rejoin_id(req)
            if rid is None:
                rid = self._next_free_replica_id(req.stage_id)
        else:
            rid = req.replica_id
            reserved = self._slots.get((req.stage_id, rid))
            if reserved is not None and reserved.head_local and not self._is_local(req):
                raise IdConflict(
                    f"replica id {rid} of stage {req.stage_id} is reserved for the head's "
                    "own replica; register without a replica id to get one assigned",
                    held_by="",
                )
            if self._held_by_another(reserved, req.replica_instance) and not self._is_own(req):
                assert reserved is not None and reserved.instance is not None
                raise IdConflict(
                    f"replica id {rid} of stage {req.stage_id} is held here by another "
                    f"live replica (from {reserved.bind_address or '?'}, epoch "
                    f"{reserved.epoch})",
                    held_by=reserved.instance,
                )
        slot = self._slots.get((req.stage_id, rid)) or self._add(Slot(req.stage_id, rid))
        self._epoch += 1
        slot.filled = True
        slot.fenced = False
        slot.epoch = self._epoch
        slot.stage_config = req.stage_config
        slot.instance = req.replica_instance
        if req.replica_instance:
            self._by_instance[(req.stage_id, req.replica_instance)] = rid
        slot.bind_address = req.replica_bind_address
        slot.binds_sockets = binds
        slot.replica_ports = ports if binds else None  # type: ignore[assignment]
        slot.coordinator_addresses = {
            "coordinator_input": req.coordinator_input,
            "coordinator_output": req.coordinator_output,
            "frontend_stats_publish_address": req.frontend_stats_publish_address,
        }
        return slot

    def held(self, stage_id: int, instance: str | None) -> Slot | None:
        """The filled slot a replica process (``instance``) holds in the stage, if any."""
        if not instance:
            return None
        rid = self._by_instance.get((stage_id, instance))
        slot = self._slots.get((stage_id, rid)) if rid is not None else None
        return slot if slot is not None and slot.filled and slot.instance == instance else None

    def release(self, stage_id: int, replica_id: int, epoch: int) -> None:
        """The replica left for good (DOWN): auto-assignment may hand out its id again,
        so ids stay small as replicas come and go. A newer registration is left alone."""
        slot = self._slots.get((stage_id, replica_id))
        if slot is not None and slot.epoch == epoch:
            slot.filled = False
            if slot.instance and self._by_instance.get((stage_id, slot.instance)) == replica_id:
                del self._by_instance[(stage_id, slot.instance)]
            self._vacated(slot)

    def fence(self, stage_id: int, replica_id: int, epoch: int) -> None:
        """That incarnation is dead (ERROR): an explicit id may take its slot over."""
        slot = self._slots.get((stage_id, replica_id))
        if slot is not None and slot.epoch == epoch:
            slot.fenced = True

    def reserve_local(self, stage_id: int, taken: set[int]) -> int:
        """The lowest replica id of the stage for one more of the head's own replicas,
        now head-local: one no slot has, or an unfilled slot, or a head-local slot whose
        replica the head no longer runs (not in ``taken``, the ids it still runs)."""
        rid = 0
        while True:
            slot = self._slots.get((stage_id, rid))
            if rid not in taken and (slot is None or not slot.filled or slot.head_local):
                break
            rid += 1
        slot = self._slots.get((stage_id, rid)) or self._add(Slot(stage_id, rid))
        slot.head_local = True
        return rid

    def unreserve(self, stage_id: int, replica_id: int) -> None:
        """The head no longer runs a replica in this slot: auto-assignment may hand the
        id out again once the slot is released."""
        slot = self._slots.get((stage_id, replica_id))
        if slot is not None:
            slot.head_local = False
            self._vacated(slot)

    def is_current(self, stage_id: int, replica_id: int, epoch: int) -> bool:
        slot = self._slots.get((stage_id, replica_id))
        return slot is not None and slot.filled and slot.epoch == epoch

    @staticmethod
    def _held_by_another(slot: Slot | None, instance: str | None) -> bool:
        return (
            slot is not None
            and slot.filled
            and not slot.fenced
            and bool(instance)
            and slot.instance is not None
            and slot.instance != instance
        )

    def _is_local(self, req: RegisterRequest) -> bool:
        # Without a key (tests, embedding) head-local slots are reserved only from
        # auto-assignment, as in the seed.
        return self._local_key is None or req.local_key == self._local_key

    def _is_own(self, req: RegisterRequest) -> bool:
        """One of the head's own replicas (it restarts them itself, after their exit)."""
        return self._local_key is not None and req.local_key == self._local_key

    def _rejoin_id(self, req: RegisterRequest) -> int | None:
        """The id a rejoining replica had here, if this is the head it had it from."""
        rid = req.previous_replica_id
        if not self.instance or req.previous_head != self.instance or rid is None:
            return None
        slot = self._slots.get((req.stage_id, rid))
        if slot is None or slot.head_local:
            return None
        return rid

    def _next_free_replica_id(self, stage_id: int) -> int:
        """The lowest vacant slot's id (not filled, not the head's), else the lowest id
        no slot has; the vacant slot stays a candidate until it is filled."""
        heap = self._maybe_vacant.setdefault(stage_id, [])
        while heap:
            slot = self._slots[(stage_id, heap[0])]
            if not slot.filled and not slot.head_local:
                return slot.replica_id
            heapq.heappop(heap)  # taken since it was pushed; pushed again if vacated
        return self._lowest_unused.get(stage_id, 0)

    def _add(self, slot: Slot) -> Slot:
        sid, rid = slot.stage_id, slot.replica_id
        self._slots[(sid, rid)] = slot
        if rid == self._lowest_unused.get(sid, 0):
            nxt = rid + 1
            while (sid, nxt) in self._slots:
                nxt += 1
            self._lowest_unused[sid] = nxt
        self._vacated(slot)
        return slot

    def _vacated(self, slot: Slot) -> None:
        if not slot.filled and not slot.head_local:
            heapq.heappush(self._maybe_vacant.setdefault(slot.stage_id, []), slot.replica_id)
