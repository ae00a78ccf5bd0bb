"""Why an answer of ``bench_chaos`` stalled: for each answer whose player ran dry over
``GAP_S``, which kills fell within its life, which of them hit a replica serving it (the
head's own log says so: its failover lines name the request, the stage and the replica),
whether that kill left the stage with no live replica, and where the dry spell sat:

- ``waiting for a restart``: a replica serving it was killed and its stage had no other
  live replica: the answer waited for one of them to come UP again;
- ``waiting for a retry``: a replica serving it was killed and the retry went to a live
  replica; the spell is the time from the kill to the retry's audio;
- ``before the talker's next sentence``: no replica of its was killed; the talker's next
  sentence came late (the CPU taken by a restart loading beside it, or others).

Times print relative to the answer's start (``+s``), so a line reads on its own.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

DRY_MIN_S = 0.2  # shorter dry spells are jitter, not a cause to explain

FAILOVER = re.compile(
    r"^(\S+ \S+) INFO \S+: request (\S+): stage (\d+) \((\w+)\) (?:replica (\d+) )?(.*)$"
)
# The coordinator's line for a replica it marked ERROR (a kill, seen by the head).
ERROR = re.compile(r"^(\S+ \S+) WARNING \S+: stage (\d+) replica (\d+) \(epoch \d+\): \w+ -> ERROR")


@dataclass
class Failover:
    at: float  # monotonic, as the bench's clocks
    stage: int
    name: str
    replica: int | None
    why: str


def dry_spells(deltas: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """When a player that starts at the first delta runs dry: (from, to) in the deltas'
    clock, as ``bench_realtime.Turn.stall_s`` counts them (their lengths sum to it)."""
    spells: list[tuple[float, float]] = []
    if not deltas:
        return spells
    until = deltas[0][0]
    for t, d in deltas:
        if t > until:
            spells.append((until, t))
            until = t
        until += d
    return spells


def _mono(stamp: str, wall_minus_mono: float) -> float:
    wall = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f")
    return time.mktime(wall.timetuple()) + wall.microsecond / 1e6 - wall_minus_mono


def read_failovers(log: Path, wall_minus_mono: float) -> dict[str, list[Failover]]:
    """The head's failover lines per request id, their times on the monotonic clock."""
    out: dict[str, list[Failover]] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = FAILOVER.match(line)
        if m is None:
            continue
        stamp, rid, sid, name, replica, why = m.groups()
        rep = int(replica) if replica is not None else None
        at = _mono(stamp, wall_minus_mono)
        out.setdefault(rid, []).append(Failover(at, int(sid), name, rep, why[:80]))
    return out


def seen_after(log: Path, wall_minus_mono: float, kills: list[dict[str, Any]]) -> list[float]:
    """Per kill, how long the head took to mark its replica ERROR (a SIGKILLed process
    is gone for the head once its last thread has exited; niced threads on busy cores
    exit late)."""
    errors: dict[tuple[int, int], list[float]] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = ERROR.match(line)
        if m is not None:
            key = (int(m.group(2)), int(m.group(3)))
            errors.setdefault(key, []).append(_mono(m.group(1), wall_minus_mono))
    out = []
    for k in kills:
        after = [t - k["at"] for t in errors.get(tuple(k["key"]), []) if t >= k["at"] - 0.05]
        if after:
            out.append(max(0.0, min(after)))
    return out


def explain(answer: Any, kills: list[dict[str, Any]], failovers: list[Failover]) -> list[str]:
    """Two or three short lines on one stalled answer (see the module's doc)."""
    t0 = answer.started
    spells = [s for s in dry_spells(answer.deltas) if s[1] - s[0] >= DRY_MIN_S]
    within = [k for k in kills if t0 - 1.0 <= k["at"] <= answer.ended]
    lines = [
        f"  {answer.kind} {answer.rid or '?'} ({answer.phase}): stall {answer.stall_s:.2f} s, "
        f"asked +0, first audio +{answer.first_audio_s or 0:.2f}, "
        f"done +{answer.ended - t0:.2f}; dry "
        + ", ".join(f"+{a - t0:.2f}..+{b - t0:.2f}" for a, b in spells)
    ]
    mine = {(f.stage, f.replica) for f in failovers}
    for k in within:
        ours = tuple(k["key"]) in mine
        up = k["up_after_s"]
        back = f"UP again +{k['at'] + up - t0:.2f}" if up is not None else "never UP"
        lines.append(
            f"    kill {k['stage']} r{k['key'][1]} at +{k['at'] - t0:.2f}"
            f"{' (its replica)' if ours else ''}"
            f"{'; the stage had no other live replica' if k['last_live'] else ''}; {back}"
        )
    for f in failovers:
        lines.append(f"    head: +{f.at - t0:.2f} stage {f.name} r{f.replica}: {f.why}")
    if spells:
        spell = max(spells, key=lambda s: s[1] - s[0])
        since = max((t for t, _ in answer.deltas if t < spell[0]), default=t0)
        lines.append(f"    -> {where(spell, since, within, mine)}")
    return lines


def where(
    spell: tuple[float, float], since: float, kills: list[dict[str, Any]], mine: set[Any]
) -> str:
    """Where the longest dry spell sat (see the module's doc). ``since``: when the audio
    before it came; a kill before that, the answer had recovered from."""
    start, end = spell
    hits = [k for k in kills if tuple(k["key"]) in mine and since - 0.5 <= k["at"] <= end]
    if not hits:
        near = [k for k in kills if abs(k["at"] - start) < 10]
        load = f" ({len(near)} kill(s) within 10 s: a restart loading)" if near else ""
        return f"before the talker's next sentence: no replica of its killed{load}"
    k = hits[-1]
    if k["last_live"]:
        return (
            f"waiting for a restart: {k['stage']} had no live replica; audio again "
            f"{end - k['at']:.2f} s after the kill"
        )
    return (
        f"waiting for a retry on the live {k['stage']}: audio again {end - k['at']:.2f} s "
        "after the kill"
    )
