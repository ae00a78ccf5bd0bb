"""Counters of the live voice sessions (``GET /v1/realtime``) of one API process.

The session code calls the event methods; ``/metrics``, the dashboard and ``omnistage
status`` read ``snapshot()``. With ``--api-server-count`` > 1 each API server process
keeps its own and reports its snapshot to the head with its response counts; whoever
renders them adds every server's up with ``combine``.

Pure state, no clock: the session measures the one duration (end of the user's speech
to the first answer audio sent) and hands it in.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from typing import Any

from omnistage.protocol.front import RealtimeSnapshot

# Upper bounds in seconds of the first-audio histogram: finer than the request latency
# buckets around the one second a spoken answer should start within (VAD's silence
# wait of ~0.5 s included).
FIRST_AUDIO_BUCKETS_S: tuple[float, ...] = (
    0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 5.0, 10.0,
)  # fmt: skip


class RealtimeStats:
    """Sessions open now and since start, turns, barge-ins, and time to first audio."""

    def __init__(self, bounds: tuple[float, ...] = FIRST_AUDIO_BUCKETS_S) -> None:
        self.bounds = bounds
        self.live_sessions = 0
        self.sessions_total = 0
        self.turns_total = 0
        self.barge_ins_total = 0
        self.first_audio_counts = [0] * (len(bounds) + 1)
        self.first_audio_sum = 0.0

    def session_opened(self) -> None:
        self.live_sessions += 1
        self.sessions_total += 1

    def session_closed(self) -> None:
        # Never below 0, so a close without its open cannot show a negative gauge.
        self.live_sessions = max(0, self.live_sessions - 1)

    def turn(self) -> None:
        """A user turn was committed (answered or not)."""
        self.turns_total += 1

    def barge_in(self) -> None:
        """The user spoke while an answer was playing and the answer was cut."""
        self.barge_ins_total += 1

    def first_audio(self, seconds: float) -> None:
        """End of the user's speech to the first answer audio sent, in seconds; a bound
        is inclusive, as Prometheus's ``le``."""
        self.first_audio_counts[bisect_left(self.bounds, seconds)] += 1
        self.first_audio_sum += seconds

    def snapshot(self) -> RealtimeSnapshot:
        return RealtimeSnapshot(
            live_sessions=self.live_sessions,
            sessions_total=self.sessions_total,
            turns_total=self.turns_total,
            barge_ins_total=self.barge_ins_total,
            bounds=self.bounds,
            first_audio_counts=list(self.first_audio_counts),
            first_audio_sum=self.first_audio_sum,
        )


def combine(snapshots: Iterable[RealtimeSnapshot]) -> RealtimeSnapshot:
    """The sum of several processes' snapshots. Histograms add bucket by bucket; one with
    other bounds (a server of another version) adds to the counters only."""
    total = RealtimeSnapshot()
    for snap in snapshots:
        total.live_sessions += snap.live_sessions
        total.sessions_total += snap.sessions_total
        total.turns_total += snap.turns_total
        total.barge_ins_total += snap.barge_ins_total
        if not snap.first_audio_counts:
            continue
        if not total.first_audio_counts:
            total.bounds = snap.bounds
            total.first_audio_counts = list(snap.first_audio_counts)
            total.first_audio_sum = snap.first_audio_sum
        elif snap.bounds == total.bounds:
            total.first_audio_counts = [
                a + b
                for a, b in zip(total.first_audio_counts, snap.first_audio_counts, strict=True)
            ]
            total.first_audio_sum += snap.first_audio_sum
    return total


def quantile(bounds: tuple[float, ...], counts: list[int], q: float) -> float | None:
    """The q-quantile (0..1) as Prometheus's histogram_quantile estimates it (the
    dashboard's ``quantile`` in JavaScript is the same): linear within the bucket the
    rank falls in, from 0 for the first; the last finite bound when it falls above
    every bound; None without observations."""
    total = sum(counts)
    if total <= 0 or not bounds:
        return None
    rank = q * total
    below = 0
    for i, n in enumerate(counts):
        if n > 0 and below + n >= rank:
            if i >= len(bounds):
                return bounds[-1]
            lo = 0.0 if i == 0 else bounds[i - 1]
            return lo + (bounds[i] - lo) * max(0.0, rank - below) / n
        below += n
    return bounds[-1]


def as_json(snap: RealtimeSnapshot) -> dict[str, Any]:
    """The snapshot as the dashboard's feed and ``GET /v1/omni/stages`` carry it:
    ``first_audio_seconds`` is ``{bounds, counts, sum, count}``, cumulative."""
    return {
        "live_sessions": snap.live_sessions,
        "sessions_total": snap.sessions_total,
        "turns_total": snap.turns_total,
        "barge_ins_total": snap.barge_ins_total,
        "first_audio_seconds": {
            "bounds": list(snap.bounds),
            "counts": list(snap.first_audio_counts),
            "sum": round(snap.first_audio_sum, 6),
            "count": sum(snap.first_audio_counts),
        },
    }
