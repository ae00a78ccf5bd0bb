"""The Ray backend's pure parts: a stage's ``ray:`` spec as Ray's actor options, and
where the master listens for a Ray cluster."""

from __future__ import annotations

import pytest

from omnistage.config.load import load_config
from omnistage.config.schema import RaySpec
from omnistage.head.options import default_master_host
from omnistage.net import detect_local_address
from omnistage.protocol.errors import ConfigError

pytest.importorskip("ray", reason="the ray extra is not installed")

from omnistage.launch.ray import _is_loopback, actor_options


def test_a_default_spec_asks_for_one_cpu_and_no_restarts_by_ray() -> None:
    opts = actor_options(RaySpec())
    assert opts["num_cpus"] == 1.0 and opts["num_gpus"] == 0.0
    # omnistage's restart policy replaces a replica; Ray must not restart it behind it.
    assert opts["max_restarts"] == 0
    assert "scheduling_strategy" not in opts and "resources" not in opts


def test_spread_gpus_memory_and_custom_resources_reach_ray() -> None:
    spec = RaySpec(
        num_cpus=2, num_gpus=0.5, memory_bytes=2**30, resources={"tts": 1}, placement="spread"
    )
    opts = actor_options(spec)
    assert opts["num_gpus"] == 0.5 and opts["memory"] == 2**30
    assert opts["resources"] == {"tts": 1} and opts["scheduling_strategy"] == "SPREAD"


@pytest.mark.parametrize(
    ("override", "path"),
    [
        ({"ray": {"num_cpus": -1}}, "ray.num_cpus"),
        ({"ray": {"placement": "everywhere"}}, "ray.placement"),
        ({"ray": {"resources": {"x": -2}}}, "ray.resources"),
        ({"ray": {"gpus": 1}}, "ray.gpus"),
    ],
)
def test_a_bad_ray_spec_fails_at_config_load_naming_the_field(override: dict, path: str) -> None:
    with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
        load_config("echo", {"1": override})


def test_loopback_addresses_are_recognised() -> None:
    assert _is_loopback("127.0.0.1:6379") and _is_loopback("ray://localhost:10001")
    assert not _is_loopback("10.0.0.1:6379") and not _is_loopback("auto")


def test_the_master_listens_where_ray_replicas_can_reach_it() -> None:
    assert default_master_host("multi_process", None) == "127.0.0.1"
    assert default_master_host("ray", None) == "127.0.0.1"  # our own Ray, on this host
    assert default_master_host("ray", "127.0.0.1:6379") == "127.0.0.1"
    # A cluster elsewhere: this host's address on the route to it (never a wildcard).
    assert default_master_host("ray", "192.0.2.77:6379") == detect_local_address("192.0.2.77", 6379)
    assert default_master_host("ray", "ray://192.0.2.77:10001") == detect_local_address(
        "192.0.2.77", 6379
    )
