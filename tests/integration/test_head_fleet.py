"""Several heads, one fleet (--omni-join): real heads, real headless replicas, real HTTP.

Every head here runs no replica of its own (``--omni-dp-size-local 0``): the replicas are
headless, given the first head's -oma/-omp, and find the other heads through it.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.integration.harness import (
    HeadProc,
    Proc,
    SteadyLoad,
    dialled_port,
    free_port,
    headless,
    wait_for,
)

TOKEN = ("--omni-auth-token", "fleet-secret")


def fleet_head(
    tmp: Path,
    name: str,
    *flags: str,
    join: HeadProc | None = None,
    config: str = "echo-1stage",
    master_port: int | None = None,
    port: int | None = None,
) -> HeadProc:
    args = [config, "--stage-id", "0", "--omni-dp-size-local", "0", *flags]
    if join is not None:
        args += ["--omni-join", f"127.0.0.1:{join.master_port}"]
    if master_port is not None:
        args += ["-oma", "127.0.0.1", "-omp", str(master_port)]
    return HeadProc(tmp, *args, name=name, port=port)


def heads_of(head: HeadProc) -> dict[str, str]:
    """master URL -> state, as ``head`` sees its fleet."""
    return {h["address"]: h["state"] for h in head.stages()["heads"]}


def url_of(head: HeadProc) -> str:
    return f"tcp://127.0.0.1:{head.master_port}"


def replicas_of(head: HeadProc) -> set[tuple[int, int]]:
    """(replica id, pid) of the UP replicas of stage 0."""
    return {(r["replica_id"], r["pid"]) for r in head.up_replicas(0)}


def wait_up(count: int, *heads: HeadProc) -> None:
    """Until every head serves HTTP and has ``count`` replicas of stage 0 UP."""
    for head in heads:
        head.wait_http()
        wait_for(lambda h=head: len(h.up_replicas(0)) == count, 60, what=f"{count} UP")


def stop_all(*procs: Proc | None) -> None:
    for proc in procs:
        if proc is not None:
            proc.stop()


def echo_config(tmp: Path, **stage: Any) -> str:
    """A one-stage echo deploy config with ``stage``'s fields (engine_args inline)."""
    args = stage.pop("engine_args", {})
    lines = [
        "pipeline: echo-fleet",
        "stages:",
        "  - stage_id: 0",
        "    name: echo",
        "    engine: echo",
        f"    engine_args: {args!r}".replace("'", '"'),
        "    final_output: true",
        *(f"    {k}: {v}" for k, v in stage.items()),
    ]
    path = tmp / "fleet.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_heads_joined_into_a_fleet_share_its_replicas_under_one_set_of_ids(
    tmp_path: Path,
) -> None:
    # Everything signed (token) and encrypted (CURVE), as a fleet across hosts would be.
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "omnistage", "curve-keys", str(keys)], check=True)
    secure = (*TOKEN, "--omni-curve-keys", str(keys))
    a = fleet_head(tmp_path, "a", *secure)
    b = c = rogue = replicas = None
    try:
        a.wait_http()
        b = fleet_head(tmp_path, "b", *secure, join=a)
        # The third joins through the second: it learns the first from it.
        b.wait_http()
        c = fleet_head(tmp_path, "c", *secure, join=b)
        c.wait_http()
        # A head without the fleet's secret is not heard.
        wrong = ("--omni-auth-token", "wrong", "--omni-curve-keys", str(keys))
        rogue = fleet_head(tmp_path, "rogue", *wrong, join=a)
        replicas = headless(tmp_path, a, 0, "--omni-dp-size-local", "2", *secure)
        everyone = {url_of(h): "UP" for h in (a, b, c)}
        for head in (a, b, c):
            wait_for(lambda h=head: heads_of(h) == everyone, 20, what=f"{head.url} sees 3 heads")
            wait_for(lambda h=head: len(h.up_replicas(0)) == 2, 20, what="2 replicas UP")
        # The same two processes under the same ids at every head.
        assert replicas_of(a) == replicas_of(b) == replicas_of(c)
        assert {rid for rid, _ in replicas_of(a)} == {0, 1}
        for i, head in enumerate((a, b, c)):
            r = head.chat(f"through head {i}")
            assert r.status_code == 200
            assert r.json()["choices"][0]["message"]["content"] == f"through head {i} [echo]"
        wait_for(lambda: "head announcement dropped" in a.log(), 20, what="a drops the rogue")
        assert url_of(rogue) not in heads_of(a)
    finally:
        stop_all(replicas, rogue, c, b, a)


def test_two_heads_that_gave_out_the_same_id_merge_into_one_set_of_ids(tmp_path: Path) -> None:
    # Two fleets of one head each, each with a replica it named 0; then a third head
    # joins both (b has been announcing to c's address all along): every replica now
    # serves every head, and the two replicas holding 0 must not share it.
    c_master = dialled_port()  # b dials it before c binds it
    a = fleet_head(tmp_path, "a")
    b = fleet_head(tmp_path, "b", "--omni-join", f"127.0.0.1:{c_master}")
    c = r1 = r2 = None
    try:
        wait_up(0, a, b)
        r1 = headless(tmp_path, a, 0)
        r2 = headless(tmp_path, b, 0)
        wait_up(1, a, b)
        assert [r["replica_id"] for r in a.up_replicas(0)] == [0]
        assert [r["replica_id"] for r in b.up_replicas(0)] == [0]
        c = fleet_head(tmp_path, "c", join=a, master_port=c_master)
        c.wait_http()
        everyone = {url_of(h): "UP" for h in (a, b, c)}
        for head in (a, b, c):
            wait_for(lambda h=head: heads_of(h) == everyone, 20, what=f"{head.url} sees 3 heads")
        for head in (a, b, c):
            wait_for(lambda h=head: len(h.up_replicas(0)) == 2, 30, what=f"both UP at {head.url}")
        wait_for(
            lambda: replicas_of(a) == replicas_of(b) == replicas_of(c), 20, what="one set of ids"
        )
        assert {rid for rid, _ in replicas_of(a)} == {0, 1}
        # Exactly one of the two gave its id up (the other kept it).
        moved = [p for p in (r1, r2) if "registering for a new id" in p.log()]
        assert len(moved) == 1, [p.log()[-2000:] for p in (r1, r2)]
        for i, head in enumerate((a, b, c)):
            assert head.chat(f"through head {i}").status_code == 200
    finally:
        stop_all(r1, r2, c, b, a)


def test_two_replicas_registering_at_once_through_two_heads_get_distinct_ids(
    tmp_path: Path,
) -> None:
    # Only one head of a fleet hands out ids (the UP one with the smallest instance):
    # the other redirects an auto-assign registration there, so the two replicas get
    # distinct ids at once and neither has to give its id up.
    a = fleet_head(tmp_path, "a")
    b = r1 = r2 = None
    try:
        a.wait_http()
        b = fleet_head(tmp_path, "b", join=a)
        b.wait_http()
        both = {url_of(a): "UP", url_of(b): "UP"}
        for head in (a, b):
            wait_for(lambda h=head: heads_of(h) == both, 20, what=f"{head.url} sees both")
        instances = {h["address"]: h["instance"] for h in a.stages()["heads"]}
        owner = min(instances, key=lambda url: instances[url])
        r1 = headless(tmp_path, a, 0, name="r1")
        r2 = headless(tmp_path, b, 0, name="r2")
        wait_up(2, a, b)
        wait_for(lambda: replicas_of(a) == replicas_of(b), 20, what="one set of ids")
        assert {rid for rid, _ in replicas_of(a)} == {0, 1}
        logs = {url_of(a): r1.log(), url_of(b): r2.log()}
        assert not [log for log in logs.values() if "registering for a new id" in log]
        # The replica pointed at the other head took its id from the owner.
        (other,) = set(logs) - {owner}
        assert f"from the fleet's id owner at {owner}" in logs[other], logs[other][-2000:]
        assert "fleet's id owner" not in logs[owner]
    finally:
        stop_all(r1, r2, b, a)


def test_a_head_killed_under_load_costs_the_other_nothing_and_is_served_again_on_restart(
    tmp_path: Path,
) -> None:
    # Heartbeat timeout 2 s: a replica gives up on a silent head after 4 s.
    config = echo_config(tmp_path, engine_args={"num_chunks": 2, "hang_on": "HANG"})
    flags = ("--omni-heartbeat-timeout", "2")
    a = fleet_head(tmp_path, "a", *flags, config=config)
    b = replicas = again = None
    orphan: list[Any] = []
    try:
        a.wait_http()
        b = fleet_head(tmp_path, "b", *flags, join=a, config=config)
        replicas = headless(tmp_path, a, 0, "--omni-dp-size-local", "2")
        wait_up(2, a, b)
        before = replicas_of(a)
        # A request that never ends, held for head a: once a dies, nobody can read it.
        hang = threading.Thread(target=lambda: orphan.append(_post(a.url, "HANG")), daemon=True)
        hang.start()
        wait_for(lambda: _others(b) == 1, 10, what="b sees the request held for a")
        load = SteadyLoad(b.url, lambda text: f"{text} [echo]", workers=3).start()
        time.sleep(1.0)
        a.signal(signal.SIGKILL)
        a.wait(5)
        time.sleep(2.0)
        load.stop()
        assert load.errors == [] and load.hung == 0
        assert load.ok > 20
        # The replicas dropped the dead head's request (no work left for nobody).
        wait_for(lambda: _others(b) == 0, 15, what="a's request dropped by its replica")
        # a, started again on its address (no --omni-join): b's announcements find it,
        # the replicas rejoin it with the ids and processes they had.
        again = fleet_head(
            tmp_path, "a2", *flags, config=config, master_port=a.master_port, port=a.port
        )
        again.wait_http()
        wait_for(lambda: replicas_of(again) == before, 20, what="replicas back with a")
        wait_for(lambda: heads_of(again).get(url_of(b)) == "UP", 10, what="a2 knows b")
        assert again.chat("after the restart").status_code == 200
        assert b.chat("b still serving").status_code == 200
    finally:
        stop_all(replicas, again, b, a)


def test_a_replica_shared_by_two_heads_takes_no_more_than_its_capacity(tmp_path: Path) -> None:
    # One replica that works on one request at a time, 0.5 s each; each head thinks it
    # has that one slot. Six requests at once, three through each head: if both heads
    # used the slot at once, they would take ~1.5 s; the replica makes them take turns.
    config = echo_config(
        tmp_path,
        engine_args={"num_chunks": 2, "chunk_delay_s": 0.25},
        max_inflight_per_replica=1,
    )
    flags = ("--omni-stage-wait-timeout", "30")
    a = fleet_head(tmp_path, "a", *flags, config=config)
    b = replicas = None
    try:
        a.wait_http()
        b = fleet_head(tmp_path, "b", *flags, join=a, config=config)
        replicas = headless(tmp_path, a, 0)
        wait_up(1, a, b)
        results: list[tuple[str, int, str]] = []

        def ask(head: HeadProc, text: str) -> None:
            r = httpx.post(
                f"{head.url}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": text}]},
                timeout=60,
            )
            content = r.json()["choices"][0]["message"]["content"] if r.is_success else r.text
            results.append((text, r.status_code, content))

        threads = [
            threading.Thread(target=ask, args=(head, f"{name} {i}"))
            for i in range(3)
            for head, name in ((a, "a"), (b, "b"))
        ]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        elapsed = time.monotonic() - started
        assert sorted(results) == sorted((t, 200, f"{t} [echo]") for t in _texts())
        assert elapsed >= 6 * 0.5 - 0.1, f"requests overlapped on the replica ({elapsed:.2f}s)"
    finally:
        stop_all(replicas, b, a)


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="needs haproxy (Debian's package)")
def test_two_heads_behind_haproxy_lose_no_request_when_one_is_killed(tmp_path: Path) -> None:
    a = fleet_head(tmp_path, "a")
    b = replicas = None
    proxy: subprocess.Popen[bytes] | None = None
    try:
        a.wait_http()
        b = fleet_head(tmp_path, "b", join=a)
        replicas = headless(tmp_path, a, 0, "--omni-dp-size-local", "2")
        wait_up(2, a, b)
        port = free_port()
        proxy = _haproxy(tmp_path, port, [a, b])
        url = f"http://127.0.0.1:{port}/v1"
        wait_for(lambda: _proxy_up(url), 10, what="haproxy serving")
        failures: list[str] = []
        answered = [0]
        stop = threading.Event()

        def client(n: int) -> None:
            # The SDK's defaults: 2 retries on connection errors and 5xx, with backoff.
            sdk = openai.OpenAI(base_url=url, api_key="none", timeout=10)
            i = 0
            while not stop.is_set():
                i += 1
                text = f"c{n} r{i}"
                try:
                    out = sdk.chat.completions.create(
                        model="echo-1stage", messages=[{"role": "user", "content": text}]
                    )
                    if out.choices[0].message.content != f"{text} [echo]":
                        failures.append(f"{text}: {out.choices[0].message.content!r}")
                    answered[0] += 1
                except openai.OpenAIError as exc:
                    failures.append(f"{text}: {exc!r}")

        clients = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(4)]
        for t in clients:
            t.start()
        time.sleep(1.5)
        a.signal(signal.SIGKILL)
        a.wait(5)
        time.sleep(3.0)
        stop.set()
        for t in clients:
            t.join(30)
        assert failures == []
        assert answered[0] > 50
        assert b.chat("b serves").status_code == 200
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(5)
        stop_all(replicas, b, a)


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="needs haproxy (Debian's package)")
def test_haproxy_resends_what_a_killed_head_had_not_started_answering(tmp_path: Path) -> None:
    """Clients with retries off: every request whose answer had not started when its head
    died is answered (haproxy's ``retry-on`` sends it to the other head); a stream that
    had started fails at the client, and is counted apart."""
    slow = echo_config(tmp_path, engine_args={"num_chunks": 4, "chunk_delay_s": 0.15})
    a = fleet_head(tmp_path, "a", config=slow)
    b = replicas = None
    proxy: subprocess.Popen[bytes] | None = None
    try:
        a.wait_http()
        b = fleet_head(tmp_path, "b", join=a, config=slow)
        replicas = headless(tmp_path, a, 0, "--omni-dp-size-local", "2")
        wait_up(2, a, b)
        port = free_port()
        proxy = _haproxy(tmp_path, port, [a, b])
        url = f"http://127.0.0.1:{port}/v1"
        wait_for(lambda: _proxy_up(url), 10, what="haproxy serving")
        plain_failed: list[str] = []
        streams_failed: list[str] = []
        answered = [0]
        stop = threading.Event()

        def client(n: int, stream: bool) -> None:
            sdk = openai.OpenAI(base_url=url, api_key="none", timeout=10, max_retries=0)
            i = 0
            while not stop.is_set():
                i += 1
                text = f"c{n} r{i}"
                msgs = [{"role": "user", "content": text}]
                try:
                    if stream:
                        parts = sdk.chat.completions.create(
                            model="echo-fleet", messages=msgs, stream=True
                        )
                        got = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
                    else:
                        out = sdk.chat.completions.create(model="echo-fleet", messages=msgs)
                        got = out.choices[0].message.content or ""
                    assert got.startswith(text), got
                    answered[0] += 1
                except (openai.OpenAIError, httpx.HTTPError) as exc:
                    (streams_failed if stream else plain_failed).append(f"{text}: {exc!r}")

        clients = [threading.Thread(target=client, args=(n, n == 3), daemon=True) for n in range(4)]
        for t in clients:
            t.start()
        wait_for(lambda: sum(r["in_flight"] for r in a.up_replicas(0)) > 0, 10, 0.01)
        held = sum(r["in_flight"] for r in a.up_replicas(0))
        a.signal(signal.SIGKILL)
        a.wait(5)
        time.sleep(3.0)
        stop.set()
        for t in clients:
            t.join(30)
        assert plain_failed == [], plain_failed  # re-sent by haproxy, not by the client
        assert held > 0 and answered[0] > 10
        # Its log marks a request sent again to another server "+N" in the retries field.
        resent = re.findall(r"/\+\d+ \d+/\d+ \"POST", (tmp_path / "haproxy.log").read_text())
        assert resent, "haproxy re-sent nothing"
        assert len(streams_failed) <= 1, streams_failed  # at most the one stream it held
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(5)
        stop_all(replicas, b, a)


def _texts() -> list[str]:
    return [f"{name} {i}" for i in range(3) for name in ("a", "b")]


def _post(url: str, text: str) -> int | str:
    try:
        body = {"messages": [{"role": "user", "content": text}]}
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code
    except httpx.HTTPError as exc:
        return repr(exc)


def _others(head: HeadProc) -> int:
    """Requests the replicas hold for the fleet's other heads, as ``head`` hears it."""
    return sum(r["other_heads_in_flight"] for r in head.up_replicas(0))


def _haproxy(tmp: Path, port: int, heads: list[HeadProc]) -> subprocess.Popen[bytes]:
    servers = "\n".join(
        f"    server h{i} 127.0.0.1:{h.port} check inter 200ms fall 1 rise 2"
        for i, h in enumerate(heads)
    )
    cfg = tmp / "haproxy.cfg"
    cfg.write_text(
        f"""global
    maxconn 256
    log stdout format raw local0 info
defaults
    mode http
    log global
    option httplog
    timeout connect 1s
    timeout client 30s
    timeout server 30s
    timeout check 1s
    retries 3
    retry-on conn-failure empty-response
    option http-buffer-request
    option redispatch
frontend api
    bind 127.0.0.1:{port}
    default_backend heads
backend heads
    balance roundrobin
    option httpchk GET /health
{servers}
"""
    )
    log = (tmp / "haproxy.log").open("wb")
    return subprocess.Popen(["haproxy", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT)


def _proxy_up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_joined_heads_on_one_postgresql_store_share_stored_responses_and_jobs(
    tmp_path: Path, postgres: Any
) -> None:
    store = ("--store-url", postgres.new_database(), "--media-url", str(tmp_path / "media"))
    a = fleet_head(tmp_path, "a", *store)
    b = replicas = None
    try:
        a.wait_http()
        b = fleet_head(tmp_path, "b", *store, join=a)
        replicas = headless(tmp_path, a, 0)
        wait_up(1, a, b)
        first = a.client.post("/v1/responses", json={"input": "turn one"}).json()
        # Read back, and continued, through the other head.
        assert b.client.get(f"/v1/responses/{first['id']}").json()["id"] == first["id"]
        r = b.client.post(
            "/v1/responses", json={"input": "turn two", "previous_response_id": first["id"]}
        )
        assert r.status_code == 200, r.text
        second = a.client.get(f"/v1/responses/{r.json()['id']}").json()
        assert second["previous_response_id"] == first["id"]
        assert second["output"][0]["content"][0]["text"] == "turn two [echo]"
        # A background response queued through one head is visible, done, at the other.
        job = b.client.post("/v1/responses", json={"input": "later", "background": True})
        rid = job.json()["id"]
        wait_for(
            lambda: a.client.get(f"/v1/responses/{rid}").json()["status"] == "completed",
            30,
            0.2,
            "the job completed, seen from the other head",
        )
    finally:
        stop_all(replicas, b, a)
