"""The connectors seam without processes: the config, the head's choice per edge, the
shared-memory ring's bookkeeping, and what a sender leaves of a chunk."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from omnistage.config.load import load_config
from omnistage.config.schema import ConnectorConfig
from omnistage.connectors import shm
from omnistage.connectors.registry import Connectors, choose
from omnistage.engines.echo_tensors import TensorTally, expected, payload
from omnistage.protocol import codec
from omnistage.protocol.chunk_meta import TensorMeta
from omnistage.protocol.enums import Modality
from omnistage.protocol.errors import ConfigError
from omnistage.protocol.messages import OutputChunk, PayloadRef, PeerConnector

_DECODER = msgspec.msgpack.Decoder(OutputChunk)

PIPELINE = """\
pipeline: tensors
stages:
  - stage_id: 0
    name: a
    engine: echo
    engine_args: {{tensor_bytes: 1024}}
  - stage_id: 1
    name: b
    engine: echo
    inputs: [0]
    final_output: true
    engine_args: {{check_tensors: true}}
    omni_kv_config:
{kv}
"""


def _load(tmp_path: Path, kv: str) -> object:
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(kv=kv))
    return load_config(str(path))


def test_an_edge_takes_the_connector_its_stage_names(tmp_path: Path) -> None:
    config = _load(
        tmp_path,
        "      - omni_from_stage: 0\n        connector_config: {name: shm, segment_bytes: 1048576}",
    )
    conn = config.connectors()[(0, 1)]  # type: ignore[attr-defined]
    assert conn.name == "shm" and conn.segment_bytes == 1 << 20


@pytest.mark.parametrize(
    ("kv", "says"),
    [
        ("      - omni_from_stage: 0\n        connector_config: {name: nixl}", "unknown connector"),
        ("      - omni_from_stage: 1\n        omni_to_stage: 0", "no edge 1 -> 0"),
        ("      - omni_from_stage: 0\n        connector_config: {segment_bytes: 10}", "65536"),
    ],
)
def test_a_bad_connector_config_fails_at_load(tmp_path: Path, kv: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, kv)
    assert says in str(info.value) and "omni_kv_config" in str(info.value)


def test_shm_between_two_hosts_falls_back_to_zmq() -> None:
    conf = ConnectorConfig(name="shm", segment_bytes=1 << 20)
    assert choose(conf, "h1", "h1") == (PeerConnector("shm", {"segment_bytes": 1 << 20}), False)
    assert choose(conf, "h1", "h2") == (PeerConnector("zmq"), True)
    assert choose(conf, "", "") == (PeerConnector("zmq"), True)  # unknown: no sharing
    assert choose(None, "h1", "h1") == (PeerConnector("zmq"), False)


def _tensor(index: int, nbytes: int) -> OutputChunk:
    meta = TensorMeta("hidden_states", "uint8", (nbytes,))
    return OutputChunk("r", 0, 0, 0, index, Modality.TEXT, data=payload(index, nbytes), meta=meta)


def test_shm_carries_tensors_by_reference_and_leaves_the_sent_chunk_alone() -> None:
    sender, receiver = Connectors(), Connectors()
    choice = PeerConnector("shm", {"segment_bytes": 1 << 16})
    try:
        tally = TensorTally()
        for start in range(0, 40, 4):  # ten times the ring's size: it wraps
            chunks = [_tensor(i, 4000) for i in range(start, start + 4)]
            text = OutputChunk("r", 0, 0, 0, 99, Modality.TEXT, text="hi")
            sent = sender.outbound("tcp://peer:1", choice, [*chunks, text])
            assert all(c.data for c in chunks)  # the head's copies keep their bytes
            assert sent[-1] is text
            for chunk in sent[:-1]:
                assert chunk.data == b"" and chunk.ref is not None
                got = codec.decode_records(codec.pack(chunk), codec.TAGS[OutputChunk], _DECODER)[0]
                assert receiver.inbound(got) and got.ref is None
                tally.add(got.data)
        n, nbytes, crc = expected(40, 4000)
        assert (tally.count, tally.nbytes, f"{tally.crc:08x}", tally.ordered) == (
            n,
            nbytes,
            crc,
            True,
        )
        # The receiver unlinked the ring's name once it had mapped it.
        assert not [
            n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"{shm.PREFIX}{os.getpid()}-")
        ]
    finally:
        sender.close()
        receiver.close()


def test_a_full_ring_or_an_oversized_tensor_goes_inline() -> None:
    sender = Connectors()
    choice = PeerConnector("shm", {"segment_bytes": 1 << 16})
    try:
        big = sender.outbound("tcp://peer:2", choice, [_tensor(0, 70_000)])
        assert big[0].ref is None and len(big[0].data) == 70_000
        # Nobody reads: the ring fills, then the rest goes inline, in order.
        sent = sender.outbound("tcp://peer:2", choice, [_tensor(i, 20_000) for i in range(5)])
        assert [c.ref is not None for c in sent] == [True, True, True, False, False]
    finally:
        sender.close()


def test_a_ring_left_by_a_dead_sender_is_swept(tmp_path: Path) -> None:
    # Nobody holds its sender lock: the process that made it is gone.
    path = Path(shm.SHM_DIR) / f"{shm.PREFIX}999999999-deadbeef"
    path.write_bytes(b"\0" * 128)
    try:
        shm.sweep()
        assert not path.exists()
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("key", ["nope", f"{shm.PREFIX}0-gone", f"{shm.PREFIX}../../etc/passwd"])
def test_a_ref_to_no_ring_drops_the_chunk(key: str) -> None:
    bad = OutputChunk("r", 0, 0, 0, 0, Modality.TEXT, ref=PayloadRef("shm", key, 0, 1))
    assert not Connectors().inbound(bad)
