"""Graceful drain: SIGTERM lets in-flight requests finish, and new work goes elsewhere."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.integration.harness import HeadProc, Proc, headless, wait_for

# Stage 2 spends 0.3 s on each of ~5 input chunks: a request takes ~1.5 s there.
SLOW_2 = json.dumps(
    {"0": {"engine_args": {"num_chunks": 5}}, "2": {"engine_args": {"chunk_delay_s": 0.3}}}
)


def _post(url: str, text: str, out: dict[str, httpx.Response]) -> None:
    with httpx.Client(base_url=url, timeout=30) as client:
        out[text] = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]}
        )


def test_sigterm_on_a_replica_drains_its_requests(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo", "--stage-id", "0", "--stage-overrides", SLOW_2)
    procs: list[Proc] = []
    try:
        head.wait_http()
        procs.append(headless(tmp_path, head, 1))
        procs += [headless(tmp_path, head, 2, name=f"s2-{i}") for i in range(2)]
        head.wait_healthy()
        head.wait_up(2, 2)
        results: dict[str, httpx.Response] = {}
        first = threading.Thread(target=_post, args=(head.url, "in flight", results))
        first.start()
        busy = wait_for(
            lambda: [r for r in head.up_replicas(2) if r["in_flight"]], 5, what="request on 2"
        )[0]
        victim = next(p for p in procs if p.pid == busy["pid"])
        victim.signal(signal.SIGTERM)
        wait_for(
            lambda: any(r["state"] == "DRAINING" for r in head.replicas(2)), 3, what="DRAINING"
        )
        # New work goes to the other replica while the victim finishes.
        second = threading.Thread(target=_post, args=(head.url, "during drain", results))
        second.start()
        first.join(30)
        second.join(30)
        assert results["in flight"].status_code == 200
        assert results["in flight"].json()["choices"][0]["message"]["content"] == (
            "in flight [thinker] [talker] [vocoder]"
        )
        assert results["during drain"].status_code == 200
        assert victim.wait(15) == 0
        states = {r["replica_id"]: r["state"] for r in head.replicas(2)}
        assert states[busy["replica_id"]] == "DOWN"
    finally:
        for p in procs:
            p.stop()
        head.stop()


def test_sigterm_on_the_head_finishes_requests_in_flight(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo", "--stage-overrides", SLOW_2)
    try:
        head.wait_healthy()
        results: dict[str, httpx.Response] = {}
        worker = threading.Thread(target=_post, args=(head.url, "last one", results))
        worker.start()
        wait_for(lambda: head.up_replicas(2)[0]["in_flight"], 5, what="request in flight")
        started = time.monotonic()
        head.signal(signal.SIGTERM)
        worker.join(30)
        assert results["last one"].status_code == 200
        assert results["last one"].json()["choices"][0]["message"]["content"].endswith("[vocoder]")
        assert head.wait(20) == 0
        assert time.monotonic() - started < 15
    finally:
        head.stop()
