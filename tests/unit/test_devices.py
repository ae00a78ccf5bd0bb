"""Devices per replica: the pure split rule and where the head and --headless apply it."""

from __future__ import annotations

import json

import pytest

from omnistage.cli.args import UsageError, build_parser
from omnistage.cli.serve import headless_options
from omnistage.config.devices import (
    DEVICE_ENV_VAR,
    DevicesError,
    device_share,
    devices_per_replica,
    parse_devices,
    split_devices,
    visible_devices,
)
from omnistage.config.load import load_config
from omnistage.head.options import HeadOptions
from omnistage.headless import HeadlessOptions
from omnistage.launch.local import replica_env
from omnistage.protocol.errors import ConfigError
from omnistage.replica.options import ReplicaOptions, decode_options

STAGE = "stage 1 (talker)"


@pytest.fixture(autouse=True)
def _no_inherited_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEVICE_ENV_VAR, raising=False)


def test_each_replica_takes_its_own_consecutive_devices() -> None:
    assert split_devices("0,1,2,3", 2, 2, STAGE) == ["0,1", "2,3"]
    assert split_devices("0,1,2,3", 4, 1, STAGE) == ["0", "1", "2", "3"]
    assert split_devices("3, 1", 2, 1, STAGE) == ["3", "1"]


def test_cpu_means_no_placement_for_any_replica() -> None:
    assert split_devices("cpu", 3, 2, STAGE) == [None, None, None]
    assert device_share("cpu", 7, 1, STAGE) is None


def test_a_split_that_does_not_fit_names_the_stage() -> None:
    with pytest.raises(DevicesError, match=r"stage 1 \(talker\): 2 replica\(s\) x 2 device"):
        split_devices("0,1,2", 2, 2, STAGE)


def test_devices_beyond_the_replicas_are_spares_for_replicas_added_later() -> None:
    # Two replicas start on 0 and 1; a third (added by an autoscaler) takes 2, a fourth 3.
    assert split_devices("0,1,2,3", 2, 1, STAGE) == ["0", "1"]
    assert device_share("0,1,2,3", 2, 1, STAGE) == "2"
    assert device_share("0,1,2,3", 3, 1, STAGE) == "3"


def test_a_replica_past_the_list_is_refused_rather_than_sharing_a_device() -> None:
    with pytest.raises(DevicesError, match=r"stage 1 \(talker\): replica 2 needs devices 4\.\.5"):
        device_share("0,1,2,3", 2, 2, STAGE)


def test_a_lone_replica_takes_only_the_devices_it_needs() -> None:
    assert split_devices("0,1,2,3", 1, 1, STAGE) == ["0"]


@pytest.mark.parametrize("bad", ["0,x", "", "0,,1", "-1", "cuda:0", "0,1,0", "\u00b2"])
def test_malformed_device_lists_are_refused(bad: str) -> None:
    with pytest.raises(DevicesError):
        parse_devices(bad)
    with pytest.raises(DevicesError, match=r"^stage 1 \(talker\): devices "):
        split_devices(bad, 1, 1, STAGE)


def test_devices_per_replica_is_explicit_else_the_engines_parallel_size_else_one() -> None:
    assert devices_per_replica(3, {"tensor_parallel_size": 2}) == 3
    assert devices_per_replica(None, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}) == 4
    assert devices_per_replica(None, {"tensor_parallel_size": 2}) == 2
    assert devices_per_replica(None, {}) == 1


def test_indices_map_through_the_launchers_own_visible_devices() -> None:
    assert visible_devices("0,1", None, STAGE) == "0,1"
    assert visible_devices("0,1", "", STAGE) == "0,1"
    assert visible_devices("2,3", "4,5,6,7", STAGE) == "6,7"
    assert visible_devices("1", "GPU-aa, GPU-bb", STAGE) == "GPU-bb"
    assert visible_devices(None, "4,5", STAGE) is None
    with pytest.raises(DevicesError, match=r"stage 1 \(talker\): device 2 is not visible"):
        visible_devices("2", "4,5", STAGE)


def test_the_config_checks_the_devices_format_and_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"stages\[1\]\.devices: must be 'cpu' or"):
        load_config("echo", {"1": {"devices": "0,x"}})
    with pytest.raises(ConfigError, match=r"stages\[1\]\.devices_per_replica"):
        load_config("echo", {"1": {"devices": "0,1", "devices_per_replica": 0}})
    stage = load_config("echo", {"1": {"devices": "0,1", "devices_per_replica": 2}}).stage(1)
    assert (stage.devices, stage.devices_each) == ("0,1", 2)


def _head(overrides: dict, **kw: object) -> HeadOptions:
    opts = HeadOptions(config=load_config("echo", overrides), **kw)  # type: ignore[arg-type]
    opts.check_devices()  # as the CLI does before anything starts
    return opts


def test_the_heads_replicas_get_their_share_by_replica_id() -> None:
    opts = _head(
        {
            "0": {"devices": "0,1,2,3", "replicas": 2},
            "1": {"devices": "0,1,2,3", "replicas": 2, "devices_per_replica": 2},
        }
    )
    got = {
        (sid, rid): opts.local_replica(sid, rid, 1, "k").visible_devices
        for sid, count in opts.local_replicas().items()
        for rid in range(count)
    }
    assert got == {(0, 0): "0", (0, 1): "1", (1, 0): "0,1", (1, 1): "2,3", (2, 0): None}


def test_with_stage_id_the_head_splits_among_its_dp_size_local_replicas() -> None:
    opts = _head({"1": {"devices": "4,5,6,7", "replicas": 0}}, stage_id=1, dp_size_local=4)
    assert [opts.local_replica(1, r, 1, "k").visible_devices for r in range(4)] == [
        "4",
        "5",
        "6",
        "7",
    ]


def test_a_head_whose_split_does_not_fit_is_a_usage_error_naming_the_stage() -> None:
    with pytest.raises(DevicesError, match=r"stage 1 \(talker\): 3 replica\(s\)"):
        _head({"1": {"devices": "0,1", "replicas": 3}})
    with pytest.raises(DevicesError, match=r"stage 1 \(talker\)"):
        _head({"1": {"devices": "0,1"}}, stage_id=1, dp_size_local=3)


def test_the_heads_shares_index_into_its_own_visible_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(DEVICE_ENV_VAR, "4,5,6,7")
    opts = _head({"1": {"devices": "2,3", "replicas": 2}})
    assert [opts.local_replica(1, r, 1, "k").visible_devices for r in range(2)] == ["6", "7"]
    monkeypatch.setenv(DEVICE_ENV_VAR, "4")
    with pytest.raises(DevicesError, match=r"stage 1 \(talker\): device 2 is not visible"):
        _head({"1": {"devices": "2,3", "replicas": 2}})


def test_an_added_head_replica_past_the_devices_is_refused() -> None:
    opts = _head({"1": {"devices": "0,1,2", "replicas": 2}})
    assert opts.local_replica(1, 2, 1, "k").visible_devices == "2"
    with pytest.raises(DevicesError, match=r"stage 1 \(talker\): replica 3"):
        opts.local_replica(1, 3, 1, "k")


def test_a_replica_child_sees_its_share_and_not_the_launchers_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(DEVICE_ENV_VAR, "0,1,2,3")
    opts = ReplicaOptions(stage_id=1, master_host="h", master_port=1, visible_devices="2")
    env = replica_env(opts)
    assert env[DEVICE_ENV_VAR] == "2"
    assert decode_options(env["OMNISTAGE_REPLICA_OPTIONS"]) == opts
    # No placement: the child inherits the launcher's visibility unchanged.
    inherited = replica_env(ReplicaOptions(stage_id=1, master_host="h", master_port=1))
    assert inherited[DEVICE_ENV_VAR] == "0,1,2,3"


def _headless(*extra: str) -> HeadlessOptions:
    argv = ["serve", "--headless", "--stage-id", "1", "-oma", "127.0.0.1", "-omp", "1", *extra]
    return headless_options(build_parser().parse_args(argv))


def test_headless_replicas_split_the_devices_of_their_own_overrides() -> None:
    opts = _headless("--omni-dp-size-local", "2", "--stage-overrides", '{"1": {"devices": "2,3"}}')
    assert opts.replica_devices() == ["2", "3"]
    opts = _headless(
        "--omni-dp-size-local",
        "2",
        "--stage-overrides",
        '{"1": {"devices": "0,1,2,3", "engine_args": {"tensor_parallel_size": 2}}}',
    )
    assert opts.replica_devices() == ["0,1", "2,3"]
    # No devices of its own: every replica inherits this process's visibility.
    assert _headless("--omni-dp-size-local", "2").replica_devices() == [None, None]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ('{"1": {"devices": "2,3"}}', r"--stage-overrides: stage 1: 3 replica\(s\)"),
        ('{"1": {"devices": "2,x"}}', r"--stage-overrides: stage 1: devices must be"),
        ('{"1": {"devices": 2}}', r"devices must be a string"),
        ('{"1": {"devices": "2,3", "devices_per_replica": 0}}', r"devices_per_replica must be"),
    ],
)
def test_a_headless_split_that_does_not_fit_is_a_usage_error(overrides: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        _headless("--omni-dp-size-local", "3", "--stage-overrides", overrides)
    # The supervisor itself raises the devices' own error (the CLI names the flag).
    replica = ReplicaOptions(
        stage_id=1, master_host="h", master_port=1, stage_overrides=json.loads(overrides)["1"]
    )
    with pytest.raises(DevicesError, match=message.removeprefix("--stage-overrides: ")):
        HeadlessOptions(replica, dp_size_local=3).replica_devices()


def test_an_autoscaled_stage_must_fit_its_max_replicas_at_start() -> None:
    scaling = {"min_replicas": 1, "max_replicas": 3}
    with pytest.raises(DevicesError, match=r"stage 1 \(talker\) with autoscaling.max_replicas 3"):
        _head({"1": {"devices": "0,1", "autoscaling": scaling}})
    opts = _head({"1": {"devices": "0,1,2", "autoscaling": scaling}})
    assert opts.local_replica(1, 2, 1, "k").visible_devices == "2"
