"""Latency-target autoscaling on a real head: one client keeps the stage well within its
time-to-first-token target on one replica; a step to six clients makes requests queue for
the replica's two slots and misses the target, so the head adds replicas for that reason
(shown in /v1/omni/stages, /metrics and the log), the target is met again, and once the
load ends the stage steps back down to one replica."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.integration.harness import HeadProc, wait_for
from tests.integration.test_autoscale import StreamingLoad

# A request streams 4 chunks 0.2 s apart: its first token ~0.2 s after it reaches a
# replica, which works on two at once; a third waits at the head.
CONFIG = """\
pipeline: latency-scaled
stages:
  - stage_id: 0
    name: worker
    engine: echo
    engine_args: {num_chunks: 4, chunk_delay_s: 0.2}
    final_output: true
    max_inflight_per_replica: 2
    autoscaling:
      min_replicas: 1
      max_replicas: 3
      target_p90_first_token_s: 0.6
      latency_window_s: 5
      latency_min_samples: 6
      upscale_delay_s: 0.5
      downscale_delay_s: 1.0
"""


def _scaling(head: HeadProc) -> dict[str, Any]:
    return head.stages()["stages"][0]["autoscaling"]


def test_a_missed_ttft_target_under_load_adds_replicas_and_says_why(tmp_path: Path) -> None:
    config = tmp_path / "latency.yaml"
    config.write_text(CONFIG)
    head = HeadProc(tmp_path, str(config), "--omni-lb-policy", "least-queue-length")
    load: StreamingLoad | None = None
    try:
        head.wait_healthy(30)
        view = _scaling(head)
        assert view["mode"] == "latency" and view["target_p90_first_token_s"] == 0.6

        # One client: within target on one replica, and nothing scales.
        load = StreamingLoad(head.url, 1)
        wait_for(
            lambda: _scaling(head)["latency"]["first_token"]["samples"] >= 6,
            15,
            what="6 first-token samples from one client",
        )
        view = _scaling(head)
        assert view["latency"]["first_token"]["p90_s"] < 0.6, view
        assert view["decisions"] == {"up": 0, "down": 0} and view["replicas"] == 1
        load.stop()
        assert load.errors == [], load.errors[:5]

        # The step: six clients queue for two slots; first tokens come ~1.8 s late.
        load = StreamingLoad(head.url, 6)
        head.wait_up(0, 3, timeout=25, what="3 UP replicas after the load step")
        view = _scaling(head)
        last = view["last_decision"]
        assert view["decisions"]["up"] >= 1 and view["decisions_by_cause"]["up"]["latency"] >= 1
        assert last["direction"] == "up" and last["cause"] == "latency", last
        assert "p90 first_token" in last["reason"] and "over target 0.6s" in last["reason"]
        assert "waiting for a replica slot" in last["reason"], last

        # Six slots for six clients: the target is met again, on fresh samples.
        def met() -> bool:
            w = _scaling(head)["latency"]["first_token"]
            return w["samples"] >= 6 and w["p90_s"] < 0.6

        wait_for(met, 15, what="p90 first token back under 0.6 s on 3 replicas")

        metrics = head.client.get("/metrics").text
        labels = 'stage_id="0",stage="worker"'
        assert (
            f'omnistage_autoscale_decisions_total{{{labels},direction="up",cause="latency"}}'
            in metrics
        )
        assert (
            f'omnistage_autoscale_latency_target_seconds{{{labels},family="first_token"}} 0.6'
            in metrics
        )

        # The load ends: one replica at a time back to one, each drained.
        load.stop()
        assert load.errors == [], load.errors[:5]
        assert load.ok > 12
        load = None
        head.wait_up(0, 1, timeout=20, what="back to 1 UP replica")
        view = _scaling(head)
        assert view["decisions"]["down"] == 2
        assert view["last_decision"]["cause"] in ("headroom", "idle"), view["last_decision"]
        log = head.log()
        assert "autoscale stage 0 (worker): up 1 -> " in log and "p90 first_token" in log
        assert "draining replica" in log and "drain timeout" not in log
    finally:
        if load is not None:
            load.lower_to(0)
        head.stop()
