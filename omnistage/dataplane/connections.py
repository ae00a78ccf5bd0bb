"""Which replica a lost connection was: the input ROUTER's connections by descriptor.

A ZMQ monitor's ``DISCONNECTED`` event names the connection's file descriptor, not its
peer. A replica's first message on the input ROUTER (its ``Ready``) says which
descriptor it came in on (``ZMQ_SRCFD``), so the head keeps descriptor -> routing ids,
and a lost connection costs a probe of the replicas seen on it, not of the fleet (at
5,000 replicas, a probe of every replica per lost connection was the head's longest
work after a crash).

A closed descriptor's number is reused, and the monitor's event and a replica's
``Ready`` come in on different sockets, in either order: so one descriptor may name
several ids (the one whose connection closed, and one that came in since on the same
number), and all of them are probed. An id still reachable once the probes of its
descriptor are over (a newer connection on the same number, or a replica whose DEALER
reconnected on another one, which sends no second ``Ready``) is no longer placed: it is
probed with every lost connection from then on, until it leaves. Ids are kept per slot
(stage, replica): a slot's newer incarnation replaces its older one, so what is kept is
bounded by the slots, whatever became of the incarnations.

Pure state, on the head's event loop.
"""

from __future__ import annotations

Slot = tuple[int, int]  # (stage_id, replica_id)


class Connections:
    def __init__(self) -> None:
        self._on_fd: dict[int, set[bytes]] = {}  # descriptor -> ids seen on it
        self._fd_of: dict[bytes, int] = {}  # id -> its descriptor, while placed
        self._unplaced: set[bytes] = set()  # ids reachable somewhere not known
        self._of_slot: dict[Slot, bytes] = {}  # slot -> its incarnation's id
        self._slot_of: dict[bytes, Slot] = {}

    def __len__(self) -> int:
        return len(self._slot_of)

    def seen(self, fd: int, identity: bytes, slot: Slot) -> None:
        """``identity`` (of ``slot``) sent a message on descriptor ``fd``."""
        older = self._of_slot.get(slot)
        if older is not None and older != identity:
            self.forget(older)
        self._unplace(identity)
        self._unplaced.discard(identity)
        self._of_slot[slot] = identity
        self._slot_of[identity] = slot
        self._fd_of[identity] = fd
        self._on_fd.setdefault(fd, set()).add(identity)

    def suspects(self, fd: int) -> list[bytes]:
        """Whom to probe for a lost connection on ``fd``: the ids seen on it, and those
        not placed."""
        return [*self._on_fd.get(fd, ()), *self._unplaced]

    def placed_on(self, fd: int) -> bool:
        """Whether any id is seen on ``fd`` (and not found gone since)."""
        return fd in self._on_fd

    def settled(self, fd: int) -> None:
        """The probes of a lost connection on ``fd`` are over: the ids seen on it that
        are still here (none was found gone) are no longer placed."""
        for identity in self._on_fd.pop(fd, ()):
            del self._fd_of[identity]
            self._unplaced.add(identity)

    def forget(self, identity: bytes) -> None:
        """``identity`` is gone (its connection found closed, or it left)."""
        self._unplace(identity)
        self._unplaced.discard(identity)
        slot = self._slot_of.pop(identity, None)
        if slot is not None and self._of_slot.get(slot) == identity:
            del self._of_slot[slot]

    def _unplace(self, identity: bytes) -> None:
        fd = self._fd_of.pop(identity, None)
        if fd is None:
            return
        ids = self._on_fd[fd]
        ids.discard(identity)
        if not ids:
            del self._on_fd[fd]
