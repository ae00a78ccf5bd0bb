"""Overload and oversized input: 429 with Retry-After, 413, and nothing else breaks."""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import httpx

from tests.integration.harness import HeadProc, wait_for

# One replica that works on 2 requests at a time, each taking ~1 s.
BUSY = json.dumps(
    {
        "0": {
            "max_inflight_per_replica": 2,
            "engine_args": {"num_chunks": 10, "chunk_delay_s": 0.1},
        }
    }
)


def test_overload_is_answered_429_with_retry_after(tmp_path: Path) -> None:
    head = HeadProc(
        tmp_path,
        "echo-1stage",
        "--stage-overrides",
        BUSY,
        "--omni-max-queue",
        "2",
        "--omni-stage-wait-timeout",
        "10",
    )
    try:
        head.wait_healthy()

        def ask(i: int) -> httpx.Response:
            with httpx.Client(base_url=head.url, timeout=30) as client:
                body = {"messages": [{"role": "user", "content": f"request number {i}"}]}
                return client.post("/v1/chat/completions", json=body)

        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            responses = list(pool.map(ask, range(10)))
        codes = sorted(r.status_code for r in responses)
        # 2 run at once and 2 may wait for a slot; the rest are refused straight away.
        assert codes.count(200) >= 4
        assert codes.count(429) >= 4
        assert set(codes) <= {200, 429}
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "stage_overloaded" and "stage 0 (echo)" in error["message"]
        for r in responses:
            if r.status_code == 200:
                assert r.json()["choices"][0]["message"]["content"].endswith("[echo]")
        # Once the burst is over the stage serves normally again.
        wait_for(lambda: head.up_replicas(0)[0]["in_flight"] == 0, 10, what="idle")
        assert head.chat("after the burst").status_code == 200
    finally:
        head.stop()


def test_oversized_bodies_get_413(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo-1stage", "--max-request-bytes", "2000")
    try:
        head.wait_healthy()
        big = {"messages": [{"role": "user", "content": "x" * 5000}]}
        r = head.client.post("/v1/chat/completions", json=big)
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"

        def chunked():  # no Content-Length: counted as it arrives
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"y" * 500
            yield b'"}]}'

        r = head.client.post(
            "/v1/chat/completions",
            content=chunked(),
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 413
        small = head.chat("fits")
        assert small.status_code == 200
    finally:
        head.stop()
