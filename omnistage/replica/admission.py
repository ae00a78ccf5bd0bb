"""What a replica serving several heads admits: each head counts only its own requests
against the replica's capacity, so the replica counts them all (see ``other_heads``)."""

from __future__ import annotations

from collections.abc import Sized
from typing import Protocol


class HoldsRequests(Protocol):
    """One head's requests on this replica (a ``requests.RequestRunner``)."""

    @property
    def requests(self) -> Sized: ...


class Admission:
    """The requests a replica holds for all its heads, against the engine's capacity."""

    def __init__(self) -> None:
        self.runners: list[HoldsRequests] = []

    def in_flight(self) -> int:
        return sum(len(r.requests) for r in self.runners)

    def others(self, runner: HoldsRequests) -> int:
        """Requests held for heads other than ``runner``'s."""
        return self.in_flight() - len(runner.requests)

    def full(self, capacity: int) -> bool:
        """No room for one more: checked only while serving several heads (one head
        never sends more than the capacity its replica reported)."""
        return len(self.runners) > 1 and self.in_flight() >= capacity
