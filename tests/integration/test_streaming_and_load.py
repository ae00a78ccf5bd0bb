"""Stage-to-stage streaming, busy replicas, advertised addresses and the API key."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai

from tests.integration.harness import HeadProc, Proc, headless


def test_downstream_stages_start_on_the_first_upstream_chunks(tmp_path: Path) -> None:
    # The thinker takes 10 x 0.2 s; if stages waited for whole outputs, nothing would
    # reach the client before ~2 s.
    slow = json.dumps({"0": {"engine_args": {"num_chunks": 10, "chunk_delay_s": 0.2}}})
    head = HeadProc(tmp_path, "echo", "--stage-overrides", slow)
    try:
        head.wait_healthy()
        body = {"messages": [{"role": "user", "content": "pipelined output"}], "stream": True}
        started = time.monotonic()
        first_content = None
        with head.client.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if first_content is None and '"content":"p' in line:
                    first_content = time.monotonic() - started
        total = time.monotonic() - started
        assert first_content is not None
        assert total >= 1.9
        assert first_content < 0.8, f"first chunk after {first_content:.2f}s of {total:.2f}s"
    finally:
        head.stop()


def test_a_replica_busy_computing_still_heartbeats(tmp_path: Path) -> None:
    # Each chunk holds the replica's event loop for 1.5 s of CPU; the heartbeat thread
    # must keep it UP under a 2 s heartbeat timeout.
    busy = json.dumps({"0": {"engine_args": {"num_chunks": 3, "cpu_cost_ms": 1500}}})
    head = HeadProc(
        tmp_path, "echo-1stage", "--stage-overrides", busy, "--omni-heartbeat-timeout", "2"
    )
    try:
        head.wait_healthy()
        r = head.client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "heavy"}]},
            timeout=30,
        )
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == "heavy [echo]"
        (replica,) = head.replicas(0)
        assert replica["state"] == "UP"
        assert replica["progress"] >= 3
        assert "ERROR" not in head.log()
    finally:
        head.stop()


def test_headless_replica_advertises_the_given_address(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo-1stage", "--stage-id", "0")
    replica: Proc | None = None
    try:
        head.wait_healthy()
        replica = headless(tmp_path, head, 0, "--omni-replica-address", "127.0.0.7")
        head.wait_up(0, 2)
        mine = head.up_replica_of(0, replica)
        assert mine["address"] == "127.0.0.7"
    finally:
        if replica is not None:
            replica.stop()
        head.stop()


def test_api_key_guards_v1_but_not_health(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo-1stage", "--api-key", "s3cret")
    try:
        head.wait_healthy()
        r = head.client.get("/v1/models")
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        wrong = head.client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert head.client.get("/health").status_code == 200
        client = openai.OpenAI(base_url=f"{head.url}/v1", api_key="s3cret", max_retries=0)
        out = client.chat.completions.create(
            model="echo-1stage", messages=[{"role": "user", "content": "with key"}]
        )
        assert out.choices[0].message.content == "with key [echo]"
        with httpx.Client(base_url=head.url) as raw:
            denied = raw.post("/v1/chat/completions", json={"messages": []})
        assert denied.status_code == 401  # auth is checked before the body
    finally:
        head.stop()


def test_replica_that_binds_its_own_sockets_is_dialled_by_the_head(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo-1stage", "--stage-id", "0")
    replica: Proc | None = None
    try:
        head.wait_healthy()
        replica = headless(
            tmp_path, head, 0, "--omni-replica-binds-sockets", "--omni-replica-address", "127.0.0.1"
        )
        head.wait_up(0, 2, what="binding replica UP")
        rid = head.up_replica_of(0, replica)["replica_id"]
        before = next(r["dispatched_total"] for r in head.up_replicas(0) if r["replica_id"] == rid)
        for i in range(8):
            r = head.chat(f"dialled {i}")
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == (
                f"dialled {i} [echo]"
            )
        after = next(r["dispatched_total"] for r in head.up_replicas(0) if r["replica_id"] == rid)
        assert after > before
    finally:
        if replica is not None:
            replica.stop()
        head.stop()
