"""The API server's view of the head (api.remote): the snapshot read back as the
service's answers, and HTTP response counts summed over every server."""

from __future__ import annotations

from collections import Counter

from omnistage.api.remote import RemoteService
from omnistage.config.load import load_config
from omnistage.protocol.front import FrontSnapshot
from omnistage.service import ReplicaStats, RequestCounts


def _service(server: int) -> RemoteService:
    # The socket only connects lazily: no head is needed to read a snapshot.
    return RemoteService(load_config("echo"), "ipc:///nonexistent/front", server, 0)


def test_the_snapshot_answers_every_state_query() -> None:
    svc = _service(1)
    load = ReplicaStats(2, 0, True, 3, 8, 1, 40)
    svc._snapshot = FrontSnapshot(
        missing=[(1, "talker")],
        status_json=b'{"pipeline": "echo", "stages": []}',
        counts=RequestCounts(10, 2, 1, 6, 0),
        entries_json=b"[]",
        loads=[load],
        waiting={0: 4},
        responses={},
    )
    assert svc.stages_without_replicas() == [(1, "talker")]
    assert svc.stages_status()["pipeline"] == "echo"
    assert svc.request_counts() == RequestCounts(10, 2, 1, 6, 0)
    assert svc.replica_loads() == [load]
    assert svc.stage_waiting() == {0: 4}
    assert svc.replica_entries() == []


def test_response_counts_are_ours_now_plus_the_others_as_last_reported() -> None:
    svc = _service(1)
    svc._snapshot = FrontSnapshot(
        missing=[],
        status_json=b"{}",
        counts=RequestCounts(0, 0, 0),
        entries_json=b"[]",
        loads=[],
        waiting={},
        # The head's copy of our own counts is stale: ours are taken live instead.
        responses={0: {200: 5, 429: 1}, 1: {200: 2}},
    )
    assert svc.response_counts(Counter({200: 3, 400: 1})) == Counter({200: 8, 429: 1, 400: 1})
