"""The master's registration socket, spoken to by a raw DEALER as the seed's client does."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from tests.integration.harness import HeadProc, wait_for

SEED_KEYS = {
    "handshake_address",
    "input_address",
    "output_address",
    "replica_id",
    "coordinator_router_address",
}


@pytest.fixture(scope="module")
def head(module_tmp: Path) -> Iterator[HeadProc]:
    # Stage 0 runs on the head (slot 0 is head-local); stages 1 and 2 await headless joins.
    h = HeadProc(module_tmp, "echo", "--stage-id", "0", name="reg-head")
    try:
        h.wait_http()
        yield h
    finally:
        h.stop()


def _register(port: int, payload: Any, raw: bytes | None = None, timeout_ms: int = 5000) -> dict:
    """What the seed's register_stage_with_omni_master does: one map out, one map back."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(raw if raw is not None else msgspec.msgpack.encode(payload))
        assert sock.poll(timeout_ms), "master did not answer"
        return msgspec.msgpack.decode(sock.recv())
    finally:
        sock.close()


def _seed_payload(stage_id: int, replica_id: int = -1) -> dict:
    # Exactly the keys the seed's client sends (no protocol_version: a seed client).
    return {
        "stage_id": stage_id,
        "replica_id": replica_id,
        "stage_config": {"engine": "echo"},
        "replica_bind_address": "127.0.0.1",
        "replica_handshake_port": 45001,
        "replica_input_port": 45002,
        "replica_output_port": 45003,
        "replica_binds_sockets": False,
    }


def test_seed_client_gets_a_full_reply(head: HeadProc) -> None:
    reply = _register(head.master_port, _seed_payload(1))
    assert reply.keys() >= SEED_KEYS
    assert reply["replica_id"] >= 0
    for key in ("handshake_address", "input_address", "output_address"):
        assert reply[key].startswith("tcp://127.0.0.1:")
    assert reply["coordinator_router_address"].startswith("tcp://127.0.0.1:")


def test_replica_binding_its_own_sockets_gets_addresses_on_its_host(head: HeadProc) -> None:
    payload = {**_seed_payload(1), "replica_binds_sockets": True}
    reply = _register(head.master_port, payload)
    assert reply["handshake_address"] == "tcp://127.0.0.1:45001"
    assert reply["input_address"] == "tcp://127.0.0.1:45002"
    assert reply["output_address"] == "tcp://127.0.0.1:45003"


def test_twenty_concurrent_auto_assign_registrations_get_distinct_ids(head: HeadProc) -> None:
    ids: list[int] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(20)

    def one() -> None:
        try:
            barrier.wait()
            ids.append(_register(head.master_port, _seed_payload(2))["replica_id"])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert len(ids) == 20 and len(set(ids)) == 20


def test_head_local_slot_is_not_given_to_auto_assign(head: HeadProc) -> None:
    reply = _register(head.master_port, _seed_payload(0))
    wait_for(lambda: head.up_replicas(0), 20, what="the head's own stage-0 replica UP")
    assert reply["replica_id"] != 0
    (local,) = [r for r in head.replicas(0) if r["replica_id"] == 0]
    assert local["local"] is True and local["state"] == "UP"


def test_a_stranger_cannot_claim_the_head_local_slot_by_naming_it(head: HeadProc) -> None:
    wait_for(lambda: head.up_replicas(0), 20, what="the head's own stage-0 replica UP")
    (local,) = [r for r in head.replicas(0) if r["replica_id"] == 0]
    reply = _register(head.master_port, _seed_payload(0, replica_id=0))
    assert "reserved for the head's own replica" in reply["error"]
    (still,) = [r for r in head.replicas(0) if r["replica_id"] == 0]
    assert (still["epoch"], still["state"], still["pid"]) == (
        local["epoch"],
        "UP",
        local["pid"],
    )


def test_unknown_stage_and_garbage_get_errors_and_the_master_keeps_serving(
    head: HeadProc,
) -> None:
    unknown = _register(head.master_port, _seed_payload(99))
    assert "unknown stage_id 99" in unknown["error"]
    garbage = _register(head.master_port, None, raw=b"\xc1\xff not msgpack")
    assert "invalid registration" in garbage["error"]
    wrong_type = _register(head.master_port, {"stage_id": "one", "replica_id": -1})
    assert "error" in wrong_type
    not_a_map = _register(head.master_port, [1, 2, 3])
    assert "error" in not_a_map
    version = _register(head.master_port, {**_seed_payload(1), "protocol_version": 99})
    assert "protocol_version 99" in version["error"]
    # ...and the next valid registration is served normally.
    ok = _register(head.master_port, _seed_payload(1))
    assert ok.keys() >= SEED_KEYS


def test_req_socket_clients_are_answered_too(head: HeadProc) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{head.master_port}")
        sock.send(msgspec.msgpack.encode(_seed_payload(1)))
        assert sock.poll(5000)
        assert msgspec.msgpack.decode(sock.recv()).keys() >= SEED_KEYS
    finally:
        sock.close()
