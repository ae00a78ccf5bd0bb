"""`omnistage status` frames rendered from captured /v1/omni/stages JSON, no head."""

from __future__ import annotations

import copy
import re
from typing import Any

from omnistage.cli.status import render, render_error, state_changes, waiting_from_metrics

NOW = 1_800_000_000.0

# GET /v1/omni/stages of `omnistage serve echo` moments after talker/0 was killed -9.
CAPTURED: dict[str, Any] = {
    "pipeline": "echo",
    "master_address": "tcp://127.0.0.1:45537",
    "lb_policy": "random",
    "heartbeat_timeout_s": 5.0,
    "stages": [
        {
            "stage_id": 0,
            "name": "thinker",
            "engine": "echo",
            "inputs": [],
            "final_output": False,
            "output_modality": "text",
            "status": "ready",
            "replicas": [
                {
                    "replica_id": 0,
                    "epoch": 1796149599437,
                    "state": "UP",
                    "reason": "ready",
                    "address": "127.0.0.1",
                    "local": True,
                    "pid": 7488,
                    "capacity": 256,
                    "queue_length": 0,
                    "in_flight": 0,
                    "reported_in_flight": 0,
                    "dispatched_total": 0,
                    "progress": 0,
                    "last_heartbeat_age_s": 0.996,
                }
            ],
        },
        {
            "stage_id": 1,
            "name": "talker",
            "engine": "echo",
            "inputs": [0],
            "final_output": False,
            "output_modality": "text",
            "status": "waiting",
            "replicas": [
                {
                    "replica_id": 0,
                    "epoch": 1796149599440,
                    "state": "ERROR",
                    "reason": "local process exited (exit code -9)",
                    "address": "127.0.0.1",
                    "local": True,
                    "pid": 7660,
                    "capacity": 256,
                    "queue_length": 0,
                    "in_flight": 0,
                    "reported_in_flight": 0,
                    "dispatched_total": 0,
                    "progress": 0,
                    "last_heartbeat_age_s": 1.539,
                }
            ],
        },
        {
            "stage_id": 2,
            "name": "vocoder",
            "engine": "echo",
            "inputs": [1],
            "final_output": True,
            "output_modality": "text",
            "status": "ready",
            "replicas": [
                {
                    "replica_id": 0,
                    "epoch": 1796149599439,
                    "state": "UP",
                    "reason": "ready",
                    "address": "127.0.0.1",
                    "local": True,
                    "pid": 7492,
                    "capacity": 256,
                    "queue_length": 0,
                    "in_flight": 0,
                    "reported_in_flight": 0,
                    "dispatched_total": 0,
                    "progress": 0,
                    "last_heartbeat_age_s": 0.937,
                }
            ],
        },
    ],
}

METRICS = """\
# HELP omnistage_stage_waiting Requests waiting for a free replica slot of the stage.
# TYPE omnistage_stage_waiting gauge
omnistage_stage_waiting{stage_id="0",stage="thinker"} 3
omnistage_stage_waiting{stage_id="1",stage="talker"} 0
omnistage_stage_waiting{stage_id="2",stage="vocoder"} 7
"""

ANSI = re.compile(r"\x1b\[")


def _richer() -> dict[str, Any]:
    """The captured JSON plus what a head may add: a second replica (remote, draining),
    restart counts, waiting counts and a list of state changes with times."""
    data = copy.deepcopy(CAPTURED)
    thinker = data["stages"][0]
    extra = dict(thinker["replicas"][0], replica_id=1, address="10.0.0.2", local=False)
    extra.update(state="DRAINING", reason="draining before shutdown", pid=None, restarts=0)
    thinker["replicas"].append(extra)
    data["stages"][1]["replicas"][0]["restarts"] = 4
    for stage in data["stages"]:
        stage["waiting"] = stage["stage_id"] * 10
    data["recent_state_changes"] = [
        {"stage_id": 0, "replica_id": 0, "state": "UP", "reason": "ready", "time": NOW - 300},
        {
            "stage_id": 1,
            "replica_id": 0,
            "state": "ERROR",
            "reason": "local process exited (exit code -9)",
            "time": NOW - 2,
        },
        {
            "stage_id": 0,
            "replica_id": 1,
            "state": "DRAINING",
            "reason": "draining before shutdown",
            "time": NOW - 30,
        },
    ]
    return data


def _line_of(frame: str, who: str) -> str:
    return next(line for line in frame.splitlines() if line.strip().startswith(who))


def test_every_stage_and_replica_appears_in_graph_order_with_inputs() -> None:
    frame = render(CAPTURED, None, NOW, color=False, url="http://127.0.0.1:8091")
    assert "pipeline echo  http://127.0.0.1:8091" in frame
    titles = [line for line in frame.splitlines() if line.startswith("stage ")]
    assert [t.split("  [")[0] for t in titles] == [
        "stage 0 thinker",
        "stage 1 talker <- thinker",
        "stage 2 vocoder <- talker",
    ]
    for who, pid in (("thinker/0", 7488), ("talker/0", 7660), ("vocoder/0", 7492)):
        assert str(pid) in _line_of(frame, who)
        assert "127.0.0.1 (local)" in _line_of(frame, who)


def test_replica_rows_show_state_load_and_heartbeat_age() -> None:
    frame = render(CAPTURED, None, NOW, color=False)
    up = _line_of(frame, "thinker/0").split()
    assert up[4:] == ["UP", "0/256", "0", "-", "1.0s", "ago"]
    assert _line_of(frame, "talker/0").split()[4] == "ERROR"


def test_a_failed_replica_shows_its_reason_and_the_pipeline_is_unavailable() -> None:
    frame = render(CAPTURED, None, NOW, color=False)
    assert "talker/0 ERROR: local process exited (exit code -9)" in frame
    assert "health unavailable (no live replica: talker)" in frame
    assert "stage 1 talker <- thinker  [engine echo, no live replica]" in frame


def test_no_colour_codes_without_color_and_state_colours_with_it() -> None:
    assert not ANSI.search(render(_richer(), METRICS, NOW, color=False))
    coloured = render(_richer(), METRICS, NOW, color=True)
    assert "\x1b[32mUP" in coloured
    assert "\x1b[31mERROR" in coloured
    assert "\x1b[33mDRAINING" in coloured


def test_colour_does_not_shift_columns() -> None:
    plain = render(_richer(), None, NOW, color=False)
    coloured = render(_richer(), None, NOW, color=True)
    assert re.sub(r"\x1b\[\d+m", "", coloured) == plain


def test_waiting_comes_from_metrics_when_the_json_lacks_it() -> None:
    assert waiting_from_metrics(METRICS) == {0: 3.0, 1: 0.0, 2: 7.0}
    frame = render(CAPTURED, METRICS, NOW, color=False)
    assert "stage 0 thinker  [engine echo, requests waiting 3]" in frame
    assert "stage 2 vocoder <- talker  [engine echo, requests waiting 7]" in frame


def test_waiting_from_the_json_wins_over_metrics() -> None:
    frame = render(_richer(), METRICS, NOW, color=False)
    assert "stage 2 vocoder <- talker  [engine echo, requests waiting 20]" in frame


def test_restarts_remote_replicas_and_recent_changes_newest_first() -> None:
    frame = render(_richer(), None, NOW, color=False)
    assert _line_of(frame, "talker/0").split()[7] == "4"
    remote = _line_of(frame, "thinker/1").split()
    assert remote[:4] == ["thinker/1", "10.0.0.2", "-", "DRAINING"]
    changes = [line.strip() for line in frame.split("recent state changes\n")[1].splitlines()]
    assert changes == [
        "2.0s ago  talker/0  ERROR  local process exited (exit code -9)",
        "30s ago  thinker/1  DRAINING  draining before shutdown",
        "5m ago  thinker/0  UP  ready",
    ]


def test_recent_changes_keep_the_last_eight_and_accept_per_replica_lists() -> None:
    data = copy.deepcopy(CAPTURED)
    data["stages"][1]["replicas"][0]["state_changes"] = [
        {"state": "ERROR", "reason": f"failure {i}", "age_s": float(i)} for i in range(12)
    ]
    changes = state_changes(data, NOW)
    assert [e["reason"] for _, who, e in changes[:2]] == ["failure 0", "failure 1"]
    frame = render(data, None, NOW, color=False)
    listed = frame.split("recent state changes\n")[1].splitlines()
    assert len(listed) == 8
    assert listed[-1].endswith("talker/0  ERROR  failure 7")


def test_no_changes_section_when_the_head_reports_none() -> None:
    assert "recent state changes" not in render(CAPTURED, None, NOW, color=False)


def test_a_stage_without_replicas_says_so() -> None:
    data = copy.deepcopy(CAPTURED)
    data["stages"][2]["replicas"] = []
    assert "  (no replicas registered)" in render(data, None, NOW, color=False)


def test_error_frame_names_the_url_and_the_error() -> None:
    frame = render_error("cannot reach the head at http://h:1: refused", "http://h:1", NOW, False)
    assert frame.startswith("http://h:1  ")
    assert "error: cannot reach the head at http://h:1: refused" in frame
    assert not ANSI.search(frame)


def test_a_replica_placed_by_ray_shows_its_node() -> None:
    placed = copy.deepcopy(CAPTURED)
    placed["stages"][0]["replicas"][0]["node"] = "c0ffee12" + "0" * 48
    frame = render(placed, None, NOW, color=False)
    assert "127.0.0.1 (local) node c0ffee12" in _line_of(frame, "thinker/0")
    assert "node" not in _line_of(render(CAPTURED, None, NOW, color=False), "thinker/0")


def test_the_fleets_heads_show_under_the_header_and_a_lone_head_shows_none() -> None:
    assert "heads" not in render(CAPTURED, None, NOW, color=False)
    data = copy.deepcopy(CAPTURED)
    data["heads"] = [
        {"address": "tcp://10.0.0.1:5000", "instance": "a", "state": "UP", "self": True},
        {"address": "tcp://10.0.0.2:5000", "instance": "b", "state": "DOWN", "self": False},
    ]
    frame = render(data, None, NOW, color=False)
    assert "heads 2: 10.0.0.1:5000 (this) UP, 10.0.0.2:5000 DOWN" in frame.splitlines()
