"""The staged Qwen2.5-Omni with its talker on another "host": a headless replica in a
network namespace of its own, joined to the head's by a veth pair, with a /dev/shm of its
own (a mount namespace), answers exactly what transformers' monolithic ``generate``
answers. The thinker -> talker edge asks for shared memory, which the two hosts do not
share: its tensors go over the ZMQ data plane, replica to replica, never through the
head. Needs root (``ip netns``, ``unshare``); skipped elsewhere.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import wait_for
from tests.integration.test_metrics import scrape, value
from tests.integration.test_multihost import MASTER_PORT, Hosts, NsHead, NsProc, two_hosts
from tests.models.test_omni_staged import _chat, reference
from tests.omni_tiny import OMNI_MAX_CODES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TALKER = {"engine_args": {"do_sample": False, "max_new_tokens": OMNI_MAX_CODES}}
# Runs the rest of its arguments with a /dev/shm of its own: another host's memory.
OWN_SHM = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
OWN_SHM += ['mount -t tmpfs tmpfs /dev/shm && exec "$@"', "own-shm"]


@pytest.fixture
def hosts(monkeypatch: pytest.MonkeyPatch) -> Iterator[Hosts]:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # every process: one thread, exact sums
    with two_hosts() as h:
        yield h


def test_a_headless_talker_on_another_host_answers_as_the_monolithic_model(
    hosts: Hosts, tmp_path: Path, omni_dir: Path
) -> None:
    master = ["-oma", hosts.head_ip, "-omp", str(MASTER_PORT)]
    # The head runs the thinker and token2wav; the talker only joins from the other host.
    head = NsHead(
        hosts,
        tmp_path,
        str(omni_dir),
        "--host",
        "0.0.0.0",
        "--stage-overrides",
        json.dumps({"1": {**TALKER, "replicas": 0}}),
        *master,
    )
    talker = NsProc(
        hosts.replica_ns,
        [
            *OWN_SHM, sys.executable, "-m", "omnistage", "serve", str(omni_dir), "--headless",
            "--stage-id", "1", "--stage-overrides", json.dumps({"1": TALKER}), *master,
        ],
        tmp_path / "talker.log",
    )  # fmt: skip
    hosts.procs.append(talker)
    head.wait_healthy(timeout=300)
    for sid in range(3):
        wait_for(lambda s=sid: head.up_replicas(s), 300, what=f"stage {sid} UP")
    (remote,) = head.up_replicas(1)
    assert remote["address"] == hosts.replica_ip and not remote["local"]
    messages = [{"role": "user", "content": "Say something about the sea."}]
    want_text, want_pcm = reference(omni_dir, messages, "Chelsie")

    text, pcm = _chat(head, messages, "Chelsie")  # type: ignore[arg-type]

    assert text == want_text
    assert pcm == want_pcm
    _, samples = scrape(head.client)
    # Both edges went replica to replica, the tensors over zmq: none through the head.
    assert value(samples, "omnistage_direct_edges_total") == 2
    assert value(samples, "omnistage_forwarded_tensor_chunks_total") == 0
    assert "do not share a host's memory; its tensors go over zmq instead of shm" in head.log()
