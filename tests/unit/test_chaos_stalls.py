"""bench/chaos_stalls.py: a chaos run's stalled answer is explained from its audio deltas,
the bench's kills and the head's failover lines (pure: no server)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

# By its path: bench/ on sys.path would shadow modules (its common.py) for other tests.
_spec = importlib.util.spec_from_file_location(
    "chaos_stalls", Path(__file__).resolve().parents[2] / "bench" / "chaos_stalls.py"
)
assert _spec is not None and _spec.loader is not None
chaos_stalls = importlib.util.module_from_spec(_spec)
sys.modules["chaos_stalls"] = chaos_stalls  # its dataclasses look their module up
_spec.loader.exec_module(chaos_stalls)


def kill(stage: str, replica: int, at: float, last_live: bool) -> dict:
    sid = {"thinker": 0, "talker": 1, "listener": 2}[stage]
    return {"stage": stage, "key": (sid, replica), "at": at, "last_live": last_live,
            "up_after_s": 3.0}  # fmt: skip


def test_dry_spells_are_when_a_player_started_at_the_first_delta_runs_dry():
    # 1 s of audio at t=10, the next at 12.5 (dry 11..12.5), then 0.5 s at 12.6 (in time).
    deltas = [(10.0, 1.0), (12.5, 0.5), (12.6, 0.5)]
    assert chaos_stalls.dry_spells(deltas) == [(11.0, 12.5)]
    assert chaos_stalls.dry_spells([]) == []


def test_a_stall_is_put_on_the_restart_the_retry_or_the_talkers_next_sentence():
    spell = (11.0, 12.5)
    talker1 = kill("talker", 1, 10.8, last_live=False)
    assert chaos_stalls.where(spell, 10.0, [talker1], {(1, 1)}).startswith(
        "waiting for a retry on the live talker: audio again 1.70 s after the kill"
    )
    last = kill("talker", 1, 10.8, last_live=True)
    assert chaos_stalls.where(spell, 10.0, [last], {(1, 1)}).startswith("waiting for a restart")
    # A kill of a replica that did not serve it: the CPU its restart took.
    why = chaos_stalls.where(spell, 10.0, [kill("listener", 0, 10.5, False)], set())
    assert why.startswith("before the talker's next sentence") and "1 kill(s)" in why
    # Its own replica's kill, but audio came after it (the retry's) before the spell.
    why = chaos_stalls.where(spell, 10.0, [kill("talker", 1, 8.0, False)], {(1, 1)})
    assert why.startswith("before the talker's next sentence")


def test_the_heads_failover_lines_name_the_replica_an_answer_lost(tmp_path: Path):
    log = tmp_path / "head.log"
    log.write_text(
        "2026-12-06 09:59:25,762 INFO omnistage.dataplane.failover: request realtime-resp_1: "
        "stage 1 (talker) replica 0 went ERROR: its connection closed; retry 1 of 2\n"
        "2026-12-06 09:59:26,000 INFO omnistage.control.master: stage 1 replica 0 registered\n"
    )
    lines = chaos_stalls.read_failovers(log, wall_minus_mono=0.0)
    [f] = lines["realtime-resp_1"]
    assert (f.stage, f.name, f.replica) == (1, "talker", 0)
    answer = SimpleNamespace(kind="realtime", rid="realtime-resp_1", phase="chaos",
                             stall_s=1.5, first_audio_s=0.3, started=f.at - 1.0,
                             ended=f.at + 3.0,
                             deltas=[(f.at - 0.7, 0.5), (f.at + 1.3, 1.0)])  # fmt: skip
    text = "\n".join(chaos_stalls.explain(answer, [kill("talker", 0, f.at - 0.1, True)], [f]))
    assert "(its replica); the stage had no other live replica" in text
    assert "-> waiting for a restart: talker had no live replica" in text


def test_a_kill_is_seen_by_the_head_when_its_replica_goes_error(tmp_path: Path):
    log = tmp_path / "head.log"
    log.write_text(
        "2026-12-06 09:59:25,000 WARNING omnistage.control.coordinator: stage 1 replica 0 "
        "(epoch 7): UP -> ERROR (local process exited (exit code -9))\n"
        "2026-12-06 09:59:40,000 WARNING omnistage.control.coordinator: stage 1 replica 0 "
        "(epoch 8): UP -> ERROR (its connection closed (unreachable on input))\n"
    )
    offset = 1000.0  # wall clock minus monotonic, as the bench takes it
    at = chaos_stalls._mono("2026-12-06 09:59:25,000", offset)
    kills = [kill("talker", 0, at - 1.5, False), kill("talker", 0, at + 13.0, False)]
    assert chaos_stalls.seen_after(log, offset, kills) == [1.5, 2.0]
