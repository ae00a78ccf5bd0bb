"""The heads of a fleet, as one head sees them: pure state, no sockets, no threads.

Heads find each other by gossip (``HeadAnnounce``): every head announces itself to every
head it knows, each interval, listing the heads it knows; whoever hears of a head it did
not know adds it. A head started with --omni-join needs one address to find them all,
and a head killed and started again (without --omni-join) is found by the others,
which keep announcing to its address. There is no leader (``id_owner`` only names the
head that hands out replica ids, by a rule every head applies alike): a head is UP while
it was heard from (an announcement or an answer) within ``down_after_s``, then DOWN; a
head DOWN for ``forget_after_s`` is forgotten.

Addresses are masters' URLs (``tcp://HOST:PORT``): where replicas register with that head.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass
class Peer:
    address: str
    instance: str = ""  # "" until it was heard from
    up: bool = False
    heard: float | None = None  # when it was last heard from
    changed: float = 0.0  # when ``up`` last changed (or it was learned)


@dataclass(frozen=True)
class PeerChange:
    """A head came UP (``up``) or went DOWN, or was forgotten (``forgotten``)."""

    address: str
    instance: str
    up: bool
    forgotten: bool = False


class FleetView:
    def __init__(
        self,
        me: str,
        instance: str,
        clock: Callable[[], float],
        down_after_s: float,
        forget_after_s: float = 600.0,
    ) -> None:
        self.me = me
        self.instance = instance
        self._clock = clock
        self.down_after_s = down_after_s
        self.forget_after_s = forget_after_s
        self._peers: dict[str, Peer] = {}
        # Bumped when the list replicas are given changes (``heads``).
        self.version = 0

    def learn(self, addresses: Iterable[str]) -> None:
        """Heads someone named: known from now on (DOWN until heard from)."""
        for address in addresses:
            if address and address != self.me and address not in self._peers:
                self._peers[address] = Peer(address, changed=self._clock())
                self.version += 1

    def heard(self, address: str, instance: str, heads: Iterable[str]) -> PeerChange | None:
        """``address`` announced itself or answered us (as ``instance``), naming
        ``heads``; returns the change if it just came UP (or restarted)."""
        if address == self.me:
            return None  # our own address given back to us (a join to ourselves)
        self.learn([address, *heads])
        peer = self._peers[address]
        now = self._clock()
        peer.heard = now
        change = None
        if not peer.up or peer.instance != instance:
            peer.up, peer.changed = True, now
            change = PeerChange(address, instance, True)
        peer.instance = instance
        return change

    def expire(self) -> list[PeerChange]:
        """Heads silent past ``down_after_s`` go DOWN; DOWN past ``forget_after_s``, gone."""
        now = self._clock()
        changes = []
        for peer in list(self._peers.values()):
            last = peer.heard if peer.heard is not None else peer.changed
            if peer.up and now - last > self.down_after_s:
                peer.up, peer.changed = False, now
                changes.append(PeerChange(peer.address, peer.instance, False))
            elif not peer.up and now - peer.changed > self.forget_after_s:
                del self._peers[peer.address]
                self.version += 1
                changes.append(PeerChange(peer.address, peer.instance, False, forgotten=True))
        return changes

    def peers(self) -> list[str]:
        """Every other head known, UP or DOWN: whom to announce to."""
        return sorted(self._peers)

    def id_owner(self) -> str | None:
        """The head that hands out replica ids in this fleet, None when this one: the UP
        head with the smallest instance. Every head picks the same one once their views
        agree, so two replicas registering at once through two heads never get the same
        id; while views disagree (a head just died or joined, a partition), two heads
        may each hand out ids, and a clash is settled by the replicas (one gives way)."""
        up = [p for p in self._peers.values() if p.up and p.instance]
        owner = min(up, key=lambda p: p.instance, default=None)
        if owner is None or owner.instance > self.instance:
            return None
        return owner.address

    def heads(self) -> list[str]:
        """What replicas are told: this head first, then the others (DOWN ones too, so
        that a replica is back with a head the moment it returns); [] when alone."""
        if not self._peers:
            return []
        return [self.me, *sorted(self._peers)]

    def snapshot(self) -> list[dict[str, object]]:
        """For /v1/omni/stages: every head, this one first."""
        now = self._clock()
        rows: list[dict[str, object]] = [
            {"address": self.me, "instance": self.instance, "state": "UP", "self": True}
        ]
        for peer in sorted(self._peers.values(), key=lambda p: p.address):
            heard = None if peer.heard is None else round(now - peer.heard, 3)
            rows.append(
                {
                    "address": peer.address,
                    "instance": peer.instance,
                    "state": "UP" if peer.up else "DOWN",
                    "self": False,
                    "last_heard_s": heard,
                }
            )
        return rows
