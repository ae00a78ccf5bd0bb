"""Tensors between stages through each connector, with real processes: an echo stage
emits a tensor per token, the next checks them (order, CRC); the head never carries
them; shared-memory rings go when a replica dies or a request is aborted; a final
sender feeds a killed talker's (or vocoder's) replacement again, without running twice."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnistage.connectors.shm import PREFIX, SHM_DIR
from omnistage.engines import echo_tensors
from tests.integration.harness import HeadProc, wait_for
from tests.integration.test_metrics import scrape, value

PIPELINE = """\
pipeline: tensors-{connector}
stages:
  - stage_id: 0
    name: thinker
    engine: echo
    engine_args: {{num_chunks: {chunks}, tensor_bytes: {nbytes}, chunk_delay_s: {delay}}}
  - stage_id: 1
    name: talker
    engine: echo
    inputs: [0]
    final_output: true
    engine_args: {{check_tensors: true}}
    omni_kv_config:
      - omni_from_stage: 0
        connector_config: {{name: {connector}, segment_bytes: {segment}}}
"""
FAST = {"chunks": 16, "nbytes": 65536, "delay": 0, "segment": 8 << 20}
SLOW = {"chunks": 40, "nbytes": 262144, "delay": 0.05, "segment": 2 << 20}
PROMPT = "tensors travel between the stages"  # longer than 40 characters with the suffix


def _start(tmp: Path, connector: str, shape: dict[str, object]) -> HeadProc:
    path = tmp / f"{connector}-{shape['chunks']}.yaml"
    path.write_text(PIPELINE.format(connector=connector, **shape))
    head = HeadProc(tmp, str(path), name=f"head-{connector}-{shape['chunks']}")
    head.wait_healthy(timeout=60)
    return head


@pytest.fixture(scope="module", params=["zmq", "shm"])
def fast_head(request: pytest.FixtureRequest, module_tmp: Path) -> Iterator[tuple[str, HeadProc]]:
    head = _start(module_tmp, request.param, FAST)
    try:
        yield request.param, head
    finally:
        head.stop()


@pytest.fixture
def slow_shm_head(tmp_path: Path) -> Iterator[HeadProc]:
    head = _start(tmp_path, "shm", SLOW)
    try:
        yield head
    finally:
        head.stop()


def tcp_received(pid: int) -> int:
    """Bytes the TCP sockets of process ``pid`` have received (``ss``'s tcp_info)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if not line[:1].isspace():
            mine = f"pid={pid}," in line
        elif mine and (found := re.search(r"bytes_received:(\d+)", line)):
            total += int(found.group(1))
    return total


def rings_mapped(pid: int) -> set[str]:
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    return set(re.findall(rf"{PREFIX}[0-9]+-[0-9a-f]+", maps))


def ring_names(pid: int) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}{pid}-")]


def _tally(answer: str, chunks: int, nbytes: int) -> dict[str, object]:
    found = echo_tensors.parse(answer)
    assert found is not None, answer
    n, total, crc = echo_tensors.expected(chunks, nbytes)
    assert (found["n"], found["bytes"], found["crc"], found["ordered"]) == (n, total, crc, "yes")
    return found


def test_tensors_arrive_intact_and_in_order_and_never_through_the_head(
    fast_head: tuple[str, HeadProc],
) -> None:
    connector, fast_head = fast_head
    head_pid = fast_head.pid
    (talker,) = fast_head.up_replicas(1)
    head0, talker0 = tcp_received(head_pid), tcp_received(talker["pid"])
    for i in range(3):
        r = fast_head.chat(f"{PROMPT} {i}")
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        assert answer.startswith(f"{PROMPT} {i} [thinker] [talker]")
        _tally(answer, FAST["chunks"], FAST["nbytes"])
    tensor_bytes = 3 * FAST["chunks"] * FAST["nbytes"]
    head_in = tcp_received(head_pid) - head0
    talker_in = tcp_received(talker["pid"]) - talker0
    # The head gets each stage's last chunk and the heartbeats, never the tensors.
    assert head_in < tensor_bytes / 20, (head_in, tensor_bytes)
    if connector == "shm":
        # Only descriptors crossed the data plane.
        assert talker_in < tensor_bytes / 20, (talker_in, tensor_bytes)
    else:
        assert talker_in >= tensor_bytes, (talker_in, tensor_bytes)


def _stream_until_tensors_flow(head: HeadProc, thinker_pid: int, talker_pid: int):  # type: ignore[no-untyped-def]
    body = {"messages": [{"role": "user", "content": PROMPT}], "stream": True}
    cm = head.client.stream("POST", "/v1/chat/completions", json=body, timeout=60)
    response = cm.__enter__()
    lines = response.iter_lines()
    next(lines)
    wait_for(lambda: rings_mapped(talker_pid), 10, what="the talker maps a ring")
    (ring,) = rings_mapped(talker_pid)
    assert ring in rings_mapped(thinker_pid)
    return cm, response, lines, ring


def _read_answer(lines) -> str:  # type: ignore[no-untyped-def]
    import json

    text = []
    for line in lines:
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text.append(choice["delta"].get("content") or "")
    return "".join(text)


def test_rings_go_when_either_replica_dies(slow_shm_head: HeadProc) -> None:
    head = slow_shm_head
    (thinker,) = head.up_replicas(0)
    (talker,) = head.up_replicas(1)
    # The receiver dies mid-answer: the sender drops its ring; the answer completes.
    cm, _, lines, ring = _stream_until_tensors_flow(head, thinker["pid"], talker["pid"])
    try:
        os.kill(talker["pid"], signal.SIGKILL)
        wait_for(lambda: ring not in rings_mapped(thinker["pid"]), 10, what="sender drops ring")
        _tally(_read_answer(lines), SLOW["chunks"], SLOW["nbytes"])
    finally:
        cm.__exit__(None, None, None)
    wait_for(lambda: head.up_replicas(1), 20, what="a new talker")
    (talker,) = head.up_replicas(1)
    # The sender dies mid-answer: the receiver drops its mapping, no name is left.
    cm, _, lines, ring = _stream_until_tensors_flow(head, thinker["pid"], talker["pid"])
    try:
        os.kill(thinker["pid"], signal.SIGKILL)
        wait_for(lambda: ring not in rings_mapped(talker["pid"]), 10, what="receiver unmaps")
        _tally(_read_answer(lines), SLOW["chunks"], SLOW["nbytes"])
    finally:
        cm.__exit__(None, None, None)
    assert ring_names(thinker["pid"]) == []


def test_aborted_requests_leave_the_ring_free(slow_shm_head: HeadProc) -> None:
    head = slow_shm_head
    (thinker,) = head.up_replicas(0)
    (talker,) = head.up_replicas(1)
    for _ in range(3):
        cm, response, _, _ = _stream_until_tensors_flow(head, thinker["pid"], talker["pid"])
        response.close()  # the client goes: the head aborts both stages
        cm.__exit__(None, None, None)
    time.sleep(1.0)
    # The aborted requests hold no ring space: a whole answer, 5x the ring's size,
    # goes by reference (a leaked ring would send it inline, through the data plane).
    before = tcp_received(talker["pid"])
    r = head.chat(PROMPT)
    assert r.status_code == 200, r.text
    _tally(r.json()["choices"][0]["message"]["content"], SLOW["chunks"], SLOW["nbytes"])
    tensor_bytes = SLOW["chunks"] * SLOW["nbytes"]
    assert tcp_received(talker["pid"]) - before < tensor_bytes / 20
    # One ring per replica pair, its name gone once the receiver mapped it.
    assert ring_names(thinker["pid"]) == []
    assert len(rings_mapped(thinker["pid"])) == 1


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = "mount -t tmpfs tmpfs /dev/shm"
    probed = subprocess.run(["unshare", "-Urm", "sh", "-c", probe], capture_output=True)
    return probed.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unprivileged user and mount namespaces")
def test_replicas_that_do_not_share_memory_fall_back_to_zmq(tmp_path: Path) -> None:
    # The talker runs with a /dev/shm of its own (a mount namespace): the same host to
    # the network, not to shared memory.
    path = tmp_path / "apart.yaml"
    config = PIPELINE.format(connector="shm", **FAST)
    path.write_text(config.replace("final_output: true", "final_output: true\n    replicas: 0"))
    head = HeadProc(tmp_path, str(path), name="head-apart")
    talker = None
    try:
        head.wait_http()
        own_shm = (
            'mount -t tmpfs tmpfs /dev/shm && exec "$0" -m omnistage serve --headless '
            f"--stage-id 1 -oma 127.0.0.1 -omp {head.master_port}"
        )
        with open(tmp_path / "talker.log", "wb") as log:
            talker = subprocess.Popen(
                ["unshare", "-Urm", "sh", "-c", own_shm, sys.executable],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        head.wait_healthy(timeout=60)
        (replica,) = head.up_replicas(1)
        before = tcp_received(replica["pid"])
        r = head.chat(PROMPT)
        assert r.status_code == 200, r.text
        _tally(r.json()["choices"][0]["message"]["content"], FAST["chunks"], FAST["nbytes"])
        # The tensors came inline, over the peer socket.
        assert tcp_received(replica["pid"]) - before >= FAST["chunks"] * FAST["nbytes"]
        assert "do not share a host's memory; its tensors go over zmq instead of shm" in head.log()
    finally:
        if talker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(talker.pid, signal.SIGKILL)
            talker.wait(10)
        head.stop()


KEEPER = """\
pipeline: keeper
stages:
  - stage_id: 0
    name: thinker
    engine: echo
    final_output: true
    engine_args: {{num_chunks: {chunks}, tensor_bytes: {nbytes}, chunk_delay_s: {delay}}}
  - stage_id: 1
    name: talker
    engine: echo
    inputs: [0]
    replicas: 2
    engine_args: {{check_tensors: true}}
    omni_kv_config:
      - omni_from_stage: 0
        connector_config: {{name: shm, segment_bytes: {segment}}}
  - stage_id: 2
    name: vocoder
    engine: echo
    inputs: [1]
    final_output: true
    replicas: 2
"""


def _choices(lines) -> dict[int, str]:  # type: ignore[no-untyped-def]
    import json

    text: dict[int, list[str]] = {}
    for line in lines:
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text.setdefault(choice["index"], []).append(choice["delta"].get("content") or "")
    return {i: "".join(parts) for i, parts in text.items()}


def _dispatched(samples: dict) -> dict[str, float]:  # type: ignore[type-arg]
    """How often the head dispatched each stage (its queue-wait histogram counts each)."""
    return {
        dict(labels)["stage_id"]: v
        for (name, labels), v in samples.items()
        if name == "omnistage_stage_queue_wait_seconds_count"
    }


def _answer_killing(head: HeadProc, stage_id: int) -> dict[int, str]:
    """A streamed answer, the busy replica of ``stage_id`` killed once tensors flow."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "stream": True}
    with head.client.stream("POST", "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        talkers = head.up_replicas(1)
        wait_for(lambda: any(rings_mapped(t["pid"]) for t in talkers), 10, what="a ring")
        (busy,) = [x for x in head.up_replicas(stage_id) if x["in_flight"] > 0]
        os.kill(busy["pid"], signal.SIGKILL)
        return _choices(lines)


def test_a_final_stage_feeds_a_killed_talkers_replacement_without_running_again(
    tmp_path: Path,
) -> None:
    # thinker -> talker -> vocoder as in Qwen2.5-Omni: the thinker is final (its text is
    # the client's) and its tensors go only to the talker, through shm. A talker, then a
    # vocoder, killed mid-answer is replaced (the talker too with the vocoder: its output
    # went with it); the thinker's replica sends the new talker every tensor again, and
    # runs once per answer.
    path = tmp_path / "keeper.yaml"
    path.write_text(KEEPER.format(**SLOW))
    head = HeadProc(tmp_path, str(path), name="head-keeper")
    try:
        head.wait_healthy(timeout=60)
        head.wait_up(1, 2)
        head.wait_up(2, 2)
        (thinker,) = head.up_replicas(0)
        for stage_id in (1, 2):
            answers = _answer_killing(head, stage_id)
            # The thinker's text once, whole; the talker's input whole and in order.
            assert answers[0] == f"{PROMPT} [thinker]"
            assert answers[1].startswith(f"{PROMPT} [thinker] [talker]")
            assert answers[1].endswith(" [vocoder]")
            _tally(answers[1], SLOW["chunks"], SLOW["nbytes"])
            wait_for(lambda s=stage_id: len(head.up_replicas(s)) == 2, 30, what="a restart")
        _, samples = scrape(head.client)
        assert value(samples, "omnistage_redirects_total") == 2
        assert value(samples, "omnistage_forwarded_tensor_chunks_total") == 0
        dispatched = _dispatched(samples)
        assert dispatched == {"0": 2, "1": 4, "2": 4}
        assert head.up_replicas(0)[0]["pid"] == thinker["pid"]
    finally:
        head.stop()


def test_a_sender_that_kept_nothing_runs_again_to_feed_a_killed_talkers_replacement(
    tmp_path: Path,
) -> None:
    # As above, but the thinker's replica keeps nothing it sent (as when what it kept was
    # dropped): it answers the head's redirect so, and the head runs the thinker again
    # with the new talker and vocoder, resuming after the text the client has.
    path = tmp_path / "keeper.yaml"
    path.write_text(KEEPER.format(**SLOW))
    mp = pytest.MonkeyPatch()
    mp.setenv("OMNISTAGE_PEER_KEPT_REQUESTS", "0")
    head = HeadProc(tmp_path, str(path), name="head-kept-nothing")
    mp.undo()
    try:
        head.wait_healthy(timeout=60)
        head.wait_up(1, 2)
        answers = _answer_killing(head, 1)
        # The thinker's text once, whole; the new talker got all its tensors and text.
        assert answers[0] == f"{PROMPT} [thinker]"
        assert answers[1].startswith(f"{PROMPT} [thinker] [talker]")
        assert answers[1].endswith(" [vocoder]")
        _tally(answers[1], SLOW["chunks"], SLOW["nbytes"])
        _, samples = scrape(head.client)
        assert value(samples, "omnistage_redirects_total") == 1
        assert value(samples, "omnistage_forwarded_tensor_chunks_total") == 0
        dispatched = _dispatched(samples)
        # The redirect's talker and vocoder, then all three again with the thinker.
        assert dispatched == {"0": 2, "1": 3, "2": 3}
        assert "nothing kept" in head.log()
    finally:
        head.stop()
