"""A slot the head is restarting, as the views show it: /v1/omni/stages (head.status),
/health, and ``omnistage status``; built from real pools and a captured-style table."""

from __future__ import annotations

import copy
from typing import Any

from starlette.testclient import TestClient

from omnistage.api.app import create_app
from omnistage.cli.status import render
from omnistage.config.load import load_config
from omnistage.control.balancing import make_policy
from omnistage.control.replica_table import ReplicaEntry
from omnistage.dataplane.stage_pool import StagePool
from omnistage.head.status import stages_status
from omnistage.protocol.messages import Reason, ReplicaState
from tests.unit.fakes import FakeService, pool_leave, pool_up, replica_entry

NOW, WALL = 500.0, 1_800_000_000.0
CONFIG = load_config("echo")


def pools() -> dict[int, StagePool]:
    out = {s.stage_id: StagePool(s.stage_id, s.name, make_policy("random")) for s in CONFIG.stages}
    for p in out.values():
        pool_up(p, 0)
    return out


def entries(**states: ReplicaState) -> list[ReplicaEntry]:
    """Replica 0 of each stage, UP unless ``states`` (by stage name) says otherwise."""
    out = []
    for s in CONFIG.stages:
        e = replica_entry(0, states.get(s.name, ReplicaState.UP), sid=s.stage_id)
        if e.state == ReplicaState.ERROR:
            e.reason, e.detail = Reason.PROCESS_EXITED, "exit code -9"
        out.append(e)
    return out


def talker_restarting(due_in: float) -> dict[int, StagePool]:
    p = pools()
    pool_leave(p[1], 0, ReplicaState.ERROR, Reason.PROCESS_EXITED)
    p[1].restart(0, NOW + due_in)
    return p


def view(p: dict[int, StagePool], e: list[ReplicaEntry]) -> dict[str, Any]:
    return stages_status(CONFIG, p, e, {}, now=NOW, wall=WALL)


def test_the_stages_view_shows_the_slot_restarting_with_its_due_time() -> None:
    status = view(talker_restarting(due_in=4.0), entries(talker=ReplicaState.ERROR))
    talker = status["stages"][1]
    assert talker["status"] == "restarting"
    (row,) = talker["replicas"]
    assert row["state"] == "ERROR"
    assert row["reason"] == "local process exited (exit code -9)"
    assert row["restarting"] == {"due_at": WALL + 4.0, "in_s": 4.0}
    assert status["stages"][0]["status"] == "ready"
    assert status["stages"][0]["replicas"][0]["restarting"] is None


def test_once_restarted_the_new_registration_row_takes_over() -> None:
    p = talker_restarting(due_in=-1.0)  # due a second ago: relaunched, not registered yet
    (row,) = view(p, entries(talker=ReplicaState.ERROR))["stages"][1]["replicas"]
    assert row["restarting"] == {"due_at": WALL - 1.0, "in_s": 0.0}
    (row,) = view(p, entries(talker=ReplicaState.STARTING))["stages"][1]["replicas"]
    assert row["state"] == "STARTING" and row["restarting"] is None


def test_a_stage_that_never_served_is_waiting_not_restarting() -> None:
    p = {s.stage_id: StagePool(s.stage_id, s.name, make_policy("random")) for s in CONFIG.stages}
    p[1].restart(0, NOW + 1)
    status = view(p, [])
    assert [s["status"] for s in status["stages"]] == ["waiting"] * 3
    # A restart with no row in the table (it exited before it registered) still shows.
    (row,) = status["stages"][1]["replicas"]
    assert row["replica_id"] == 0 and row["restarting"]["in_s"] == 1.0


class Service(FakeService):
    def __init__(self, p: dict[int, StagePool], e: list[ReplicaEntry]) -> None:
        super().__init__(tuple((s.stage_id, s.name) for s in CONFIG.stages))
        self._pools, self._entries = p, e

    def stages_without_replicas(self) -> list[tuple[int, str]]:
        return [(sid, p.name) for sid, p in self._pools.items() if not p.live()]

    def stages_status(self) -> dict[str, Any]:
        return view(self._pools, self._entries)


def health(service: Service) -> tuple[int, dict[str, Any]]:
    with TestClient(create_app(service)) as client:
        r = client.get("/health")
    return r.status_code, r.json()


def test_health_is_200_restarting_while_the_missing_replica_comes_back() -> None:
    code, body = health(Service(talker_restarting(4.0), entries(talker=ReplicaState.ERROR)))
    assert code == 200
    assert body == {
        "status": "restarting",
        "restarting": [
            {
                "stage_id": 1,
                "name": "talker",
                "replicas": [{"replica_id": 0, "state": "ERROR", "due_at": WALL + 4.0}],
            }
        ],
    }


def test_health_is_503_naming_the_stage_nothing_will_serve() -> None:
    p = talker_restarting(4.0)
    pool_leave(p[2], 0, ReplicaState.ERROR, Reason.PROCESS_EXITED)  # not coming back
    e = entries(talker=ReplicaState.ERROR, vocoder=ReplicaState.ERROR)
    code, body = health(Service(p, e))
    assert code == 503
    assert body["status"] == "unavailable"
    assert body["error"]["message"] == "no live replica for stage(s) 2 (vocoder)"
    assert [s["stage_id"] for s in body["restarting"]] == [1]
    p[1].restart(0, None)  # the restart is given up: both stages are unavailable
    code, body = health(Service(p, e))
    assert code == 503
    assert body["error"]["message"] == "no live replica for stage(s) 1 (talker), 2 (vocoder)"
    assert "restarting" not in body


def test_health_stays_ok_and_unchanged_with_every_stage_live() -> None:
    assert health(Service(pools(), entries())) == (200, {"status": "ok"})


def test_omnistage_status_says_restarting_and_when() -> None:
    status = copy.deepcopy(view(talker_restarting(due_in=4.0), entries(talker=ReplicaState.ERROR)))
    frame = render(status, None, WALL, color=False)
    assert "health restarting (no live replica, one coming back: talker)" in frame
    assert "stage 1 talker" in frame and "no live replica, one coming back" in frame
    assert "talker/0 ERROR: local process exited (exit code -9); restarting in 4.0s" in frame
