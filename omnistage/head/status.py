"""The head's state as ``GET /v1/omni/stages`` shows it: stages, replicas, load.

Pure: built from the stage config, the pools (the head's own view of load) and a
snapshot of the replica table (the coordinator's view), so it can be tested alone.
"""

from __future__ import annotations

import time
from typing import Any

from omnistage.config.schema import DeployConfig
from omnistage.control.replica_table import ReplicaEntry
from omnistage.dataplane.stage_pool import ReplicaHandle, StagePool
from omnistage.head.history import History
from omnistage.protocol.messages import ReplicaState


def stages_status(
    config: DeployConfig,
    pools: dict[int, StagePool],
    entries: list[ReplicaEntry],
    head: dict[str, Any],
    now: float | None = None,
    history: History | None = None,
    scaling: dict[int, dict[str, Any]] | None = None,
    nodes: dict[tuple[int, int], str] | None = None,
    wall: float | None = None,
) -> dict[str, Any]:
    """``now``: time.monotonic(); ``wall``: time.time() at the same moment."""
    now = time.monotonic() if now is None else now
    wall = time.time() if wall is None else wall
    restarts = history.restarts if history is not None else {}
    stages = []
    for stage in config.stages:
        pool = pools[stage.stage_id]
        replicas = [
            _replica(e, pool, now, restarts.get(e.key, 0), (nodes or {}).get(e.key))
            for e in entries
            if e.stage_id == stage.stage_id
        ]
        _add_restarts(replicas, pool, now, wall)
        stages.append(
            {
                "stage_id": stage.stage_id,
                "name": stage.name,
                "engine": stage.engine,
                "inputs": list(stage.inputs),
                "final_output": stage.final_output,
                "output_modality": stage.output_modality,
                # restarting: none live, and requests wait for one coming back.
                "status": _stage_status(pool),
                "waiting": pool.waiting,
                # The stage's balancing policy, and how many requests it placed for which
                # reason (cache: the replica held more of the prompt's prefix; load: the
                # policy's load rule; affinity: the session's last turn went there).
                "lb_policy": pool.policy.name,
                "routing": dict(pool.decisions),
                "replicas": replicas,
                # None: a fixed replica count (no ``autoscaling`` in the deploy config).
                "autoscaling": (scaling or {}).get(stage.stage_id),
            }
        )
    changes = history.recent() if history is not None else []
    return {
        "pipeline": config.pipeline,
        **head,
        "stages": stages,
        "recent_state_changes": changes,
    }


# The row of a slot the head restarts whose replica never registered.
_NO_ENTRY: dict[str, Any] = {
    "epoch": 0,
    "state": str(ReplicaState.ERROR),
    "reason": "exited before it registered",
    "address": "",
    "local": True,
    "node": None,
    "pid": 0,
    "capacity": 0,
    "in_flight": 0,
    "queue_length": 0,
    "restarts": 0,
}


def _stage_status(pool: StagePool) -> str:
    if pool.has_live():
        return "ready"
    return "restarting" if pool.comebacks.restarting else "waiting"


def _add_restarts(replicas: list[dict[str, Any]], pool: StagePool, now: float, wall: float) -> None:
    """Mark the rows of the slots the head is restarting (``restarting``: when it is
    due, unix time, and in how many seconds, 0 once it is past), and add a row for one
    the table has no entry for."""
    due = pool.comebacks.restarts()
    rows = {r["replica_id"]: r for r in replicas}
    for rid, at in sorted(due.items()):
        row = rows.get(rid)
        if row is None:
            row = {**_NO_ENTRY, "replica_id": rid}
            replicas.append(row)
        elif row["state"] in (ReplicaState.UP, ReplicaState.STARTING):
            continue  # its new registration is on the way: that row says how it goes
        left = at - now
        row["restarting"] = {"due_at": round(wall + left, 3), "in_s": round(max(0.0, left), 3)}
    replicas.sort(key=lambda r: r["replica_id"])


def _replica(
    e: ReplicaEntry, pool: StagePool, now: float, restarts: int, node: str | None = None
) -> dict[str, Any]:
    handle = pool.replicas.get(e.replica_id)
    # The pool's counts belong to this incarnation only if the epochs match.
    live = handle if handle is not None and handle.epoch == e.epoch else None
    return {
        "replica_id": e.replica_id,
        "epoch": e.epoch,
        "state": str(e.state),
        "reason": e.starting if e.state == ReplicaState.STARTING and e.starting else e.why,
        "address": e.address,
        "local": e.local,
        # The node a backend placed it on (--worker-backend ray); None: a process.
        "node": node,
        "pid": e.pid,
        # What its engine computes on (e.g. "int4-avx512vnni"; "" where it does not say).
        "kernel": e.kernel,
        "capacity": e.capacity,
        "queue_length": e.queue_length,
        "in_flight": live.in_flight if live else 0,
        "reported_in_flight": e.in_flight,
        # What it holds for the fleet's other heads (0 with one head).
        "other_heads_in_flight": e.others,
        "dispatched_total": live.dispatched_total if live else 0,
        # Of the prompt tokens it read (its requests' usage), those its prefix cache had.
        "prompt_tokens_total": live.prompt_tokens_total if live else 0,
        "cached_tokens_total": live.cached_tokens_total if live else 0,
        **_prefix_counts(pool, live),
        "progress": e.progress,
        "last_heartbeat_age_s": round(now - e.last_seen, 3),
        "restarts": restarts,
        # Set while the head restarts this slot (see _add_restarts).
        "restarting": None,
    }


def _prefix_counts(pool: StagePool, live: ReplicaHandle | None) -> dict[str, Any]:
    """What a cache-aware stage's index holds for the replica: the keys it last reported
    (None: it never reported) and those the head routed there and assumes cached."""
    if pool.prefixes is None or live is None:
        return {"cached_prefixes": None, "routed_prefixes": 0}
    return {
        "cached_prefixes": pool.prefixes.reported_count(live.replica_id),
        "routed_prefixes": pool.prefixes.routed_count(live.replica_id),
    }
