"""--api-server-count: API server processes in front of the head's orchestrator.

Real processes: the head, its replicas and two API servers sharing the HTTP socket.
Everything the API does with one process it must do through the servers: answers,
streams, errors with their status codes, health, status and metrics, aborts when the
client leaves, the API key; and a server that dies is started again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import psutil
import pytest
from websockets.sync.client import connect as ws_connect

from omnistage.launch.restart import SETTLE_S
from tests.integration.harness import HeadProc, wait_for
from tests.integration.test_metrics import scrape, value

SLOW = '{"0": {"engine_args": {"num_chunks": 50, "chunk_delay_s": 0.05}}}'


def _complete(head: HeadProc, prompt: str) -> httpx.Response:
    """On a new connection (the kernel hands each to either server), a quick request."""
    body = {"prompt": prompt, "stage_params": {"0": {"num_chunks": 1}}}
    with httpx.Client(base_url=head.url, headers=head.client.headers) as client:
        return client.post("/v1/completions", json=body)


def _api_servers(head: HeadProc) -> list[int]:
    """PIDs of the head's API server processes."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == head.pid and b"omnistage.api.server" in cmd:
            found.append(int(entry))
    return sorted(found)


@pytest.fixture(scope="module")
def fronted(module_tmp: Path) -> Iterator[HeadProc]:
    head = HeadProc(
        module_tmp,
        "echo",
        "--api-server-count",
        "2",
        "--stage-overrides",
        SLOW,
        "--api-key",
        "k",
        name="fronted-head",
    )
    head.client.headers["Authorization"] = "Bearer k"
    try:
        head.wait_healthy()
        wait_for(lambda: len(_api_servers(head)) == 2, 20, what="two API servers")
        yield head
    finally:
        head.stop()


def test_answers_and_streams_go_through_the_api_servers(fronted: HeadProc) -> None:
    for i in range(6):  # enough connections that both servers take some
        with httpx.Client(base_url=fronted.url, headers=fronted.client.headers) as c:
            r = c.post(
                "/v1/completions",
                json={"prompt": f"p{i}", "stage_params": {"0": {"num_chunks": 2}}},
            )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == f"p{i} [thinker] [talker] [vocoder]"
        assert r.json()["usage"]["total_tokens"] > 0
    body = {"messages": [{"role": "user", "content": "stream"}], "stream": True}
    with fronted.client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    assert "[vocoder]" in text and text.rstrip().endswith("data: [DONE]")


def test_errors_keep_their_status_and_shape(fronted: HeadProc) -> None:
    r = fronted.client.post("/v1/completions", json={"prompt": "x", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = fronted.chat("x", stage_params={"nowhere": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stage_params"
    assert httpx.get(f"{fronted.url}/v1/models").status_code == 401  # no key


def test_health_status_and_metrics_come_from_the_head(fronted: HeadProc) -> None:
    assert fronted.client.get("/health").json() == {"status": "ok"}
    stages = fronted.stages()["stages"]
    assert [s["name"] for s in stages] == ["thinker", "talker", "vocoder"]
    _, before = scrape(fronted.client)
    assert fronted.chat("count me", stage_params={"0": {"num_chunks": 1}}).status_code == 200

    def counted() -> bool:
        _, now = scrape(fronted.client)
        started = "omnistage_requests_started_total"
        return value(now, started) >= value(before, started) + 1

    wait_for(counted, 5, 0.1, "the request counted in /metrics")
    # Live voice sessions are counted per API server and summed; none here.
    _, now = scrape(fronted.client)
    assert value(now, "omnistage_realtime_live_sessions") == 0
    assert value(now, "omnistage_realtime_first_audio_seconds_count") == 0
    assert fronted.stages()["realtime"]["sessions_total"] == 0


def test_a_client_that_leaves_aborts_its_request_in_the_head(fronted: HeadProc) -> None:
    body = {"messages": [{"role": "user", "content": "long"}], "stream": True}
    with fronted.client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # started, 2.5 s of chunks to go: hang up now

    def idle() -> bool:
        _, samples = scrape(fronted.client)
        return value(samples, "omnistage_requests_in_flight") == 0

    wait_for(idle, 3, 0.1, "the abandoned request aborted in the head")


def test_a_dead_api_server_is_started_again(fronted: HeadProc) -> None:
    victim = _api_servers(fronted)[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(
        lambda: len(s := _api_servers(fronted)) == 2 and victim not in s,
        20,
        what="a new API server",
    )
    deadline = time.monotonic() + 10
    ok = 0
    while ok < 4 and time.monotonic() < deadline:
        with httpx.Client(base_url=fronted.url, headers=fronted.client.headers) as c:
            r = c.post(
                "/v1/completions",
                json={"prompt": "again", "stage_params": {"0": {"num_chunks": 1}}},
            )
        ok += r.status_code == 200
    assert ok == 4


def test_an_api_server_that_served_is_started_again_at_once(fronted: HeadProc) -> None:
    """The replicas' restart rule: killed after it served SETTLE_S, an API server is
    started again with no delay; its successor killed at once backs off (a crash loop)."""
    before = set(_api_servers(fronted))
    victim = min(before, key=lambda pid: psutil.Process(pid).create_time())
    time.sleep(max(0.0, psutil.Process(victim).create_time() + SETTLE_S + 0.5 - time.time()))
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: f"(pid {victim}) exited" in fronted.log(), 10, what="the exit logged")
    assert f"(pid {victim}) exited with code -9; starting it again in 0s" in fronted.log()

    wait_for(lambda: len(set(_api_servers(fronted)) - before) == 1, 10, what="its successor")
    (successor,) = set(_api_servers(fronted)) - before
    os.kill(successor, signal.SIGKILL)
    wait_for(lambda: f"(pid {successor}) exited" in fronted.log(), 10, what="the exit logged")
    assert f"(pid {successor}) exited with code -9; starting it again in 1s" in fronted.log()
    wait_for(lambda: len(_api_servers(fronted)) == 2, 20, what="two API servers again")


def test_a_stage_without_replicas_is_a_503_with_retry_after(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo", "--stage-id", "0", "--api-server-count", "2")
    try:
        head.wait_http()
        wait_for(lambda: head.client.get("/health").status_code == 503, 10, what="503 health")
        r = head.chat("x")
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "stage_unavailable"
    finally:
        head.stop()


def test_requests_of_an_api_server_that_died_are_aborted_in_the_head(tmp_path: Path) -> None:
    wedge = '{"0": {"engine_args": {"hang_on": "WEDGE"}}}'
    head = HeadProc(tmp_path, "echo-1stage", "--api-server-count", "2", "--stage-overrides", wedge)
    clients: list[threading.Thread] = []
    try:
        head.wait_healthy()
        wait_for(lambda: len(_api_servers(head)) == 2, 20, what="two API servers")

        def stuck() -> None:  # answered only when its server dies
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{head.url}/v1/completions", json={"prompt": "WEDGE"}, timeout=30)

        clients = [threading.Thread(target=stuck, daemon=True) for _ in range(4)]
        for t in clients:
            t.start()

        def in_flight() -> float | None:
            # A new connection each time: the servers are killed and started again.
            try:
                with httpx.Client(base_url=head.url, timeout=5) as client:
                    _, samples = scrape(client)
            except httpx.HTTPError:
                return None
            return value(samples, "omnistage_requests_in_flight")

        wait_for(lambda: in_flight() == 4, 10, 0.1, "four wedged requests in the head")
        for pid in _api_servers(head):
            os.kill(pid, signal.SIGKILL)
        # New servers take over; the head notices the old ones' silence and aborts
        # what they had asked for, instead of running it for nobody.
        wait_for(lambda: in_flight() == 0, 15, 0.2, "orphaned requests aborted")
        assert "its API server went silent" in head.log()
    finally:
        head.stop()
        for t in clients:
            t.join(5)


def test_the_dashboard_and_its_event_stream_go_through_the_api_servers(
    fronted: HeadProc,
) -> None:
    assert httpx.get(f"{fronted.url}/dashboard").status_code == 200  # no key: no data in it
    assert httpx.get(f"{fronted.url}/v1/omni/events").status_code == 401
    for _ in range(4):  # new connections: the kernel hands them to either server
        url = f"{fronted.url}/v1/omni/events"
        with httpx.stream("GET", url, params={"api_key": "k"}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert "event: stages" in lines
            body = next(lines).removeprefix("data: ")
        names = [s["name"] for s in msgspec.json.decode(body)["stages"]]
        assert names == ["thinker", "talker", "vocoder"]


def test_live_voice_sessions_of_every_server_add_up(fronted: HeadProc) -> None:
    """Each server counts the WebSockets it holds; /metrics and /v1/omni/stages on either
    show the sum (sessions spread over both servers as the kernel hands out connections)."""
    url = fronted.url.replace("http://", "ws://") + "/v1/realtime"
    _, before = scrape(fronted.client)
    opened_before = value(before, "omnistage_realtime_sessions_total")
    headers = {"Authorization": "Bearer k"}

    def live(n: int) -> bool:
        # A new connection each time: it may reach either server.
        with httpx.Client(base_url=fronted.url) as c:
            _, now = scrape(c)
        return value(now, "omnistage_realtime_live_sessions") == n

    with contextlib.ExitStack() as stack:
        for _ in range(4):
            ws = stack.enter_context(ws_connect(url, additional_headers=headers))
            assert msgspec.json.decode(ws.recv(timeout=10))["type"] == "session.created"
        for _ in range(4):
            wait_for(lambda: live(4), 10, 0.1, "4 live sessions in /metrics")
        # The head sums what each server last reported: it may be one report behind.
        wait_for(
            lambda: fronted.stages()["realtime"]["live_sessions"] == 4,
            10,
            0.1,
            "4 live sessions in /v1/omni/stages",
        )
    for _ in range(4):
        wait_for(lambda: live(0), 10, 0.1, "no live sessions once they closed")
    _, after = scrape(fronted.client)
    assert value(after, "omnistage_realtime_sessions_total") == opened_before + 4
