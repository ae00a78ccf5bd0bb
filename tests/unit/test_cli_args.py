"""The serve flags as data (cli/flags.py), the parser built from them and validation
(cli/args.py), in process: the command-line end to end is tests/integration/test_cli.py."""

from __future__ import annotations

import argparse
import copy

import pytest

from omnistage import defaults
from omnistage.api.server_options import ApiServerOptions, decode_options, encode_options
from omnistage.cli.args import ChoiceError, UsageError, build_parser, validate
from omnistage.cli.flags import SERVE_GROUPS
from omnistage.cli.main import main
from omnistage.cli.serve import head_options, headless_options
from omnistage.config.load import load_config
from omnistage.control.balancing import POLICIES

M = ["-oma", "127.0.0.1", "-omp", "1"]


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def _serve_help() -> str:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"].format_help()


def test_every_serve_flag_is_declared_once() -> None:
    names = [name for _, flags in SERVE_GROUPS for f in flags for name in f.names]
    assert len(names) == len(set(names))
    dests = {f.dest for _, flags in SERVE_GROUPS for f in flags}
    assert dests <= set(vars(_parse()))


def test_help_shows_the_defaults_of_defaults_py() -> None:
    text = " ".join(_serve_help().split())
    assert f"HTTP port (default {defaults.HTTP_PORT})" in text
    assert f"(default {defaults.HEARTBEAT_TIMEOUT_S})" in text
    assert f"(default {defaults.LB_POLICY})" in text
    assert f"(default {defaults.STALL_TIMEOUT_S:g}, or the heartbeat timeout" in text
    assert "{" + ",".join(POLICIES) + "}" in text


def test_secrets_from_the_environment_are_defaults_but_never_shown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMNISTAGE_API_KEY", "sekrit-key")
    monkeypatch.setenv("OMNISTAGE_AUTH_TOKEN", "sekrit-token")
    args = _parse()
    assert (args.api_key, args.omni_auth_token) == ("sekrit-key", "sekrit-token")
    assert "sekrit" not in _serve_help()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--omni-lb-policy", "fastest"], "--omni-lb-policy='fastest' is not one of: random,"),
        (["--omni-restart-policy", "maybe"], "--omni-restart-policy='maybe' is not one of:"),
        (["--worker-backend", "threads"], "--worker-backend='threads' is not one of:"),
    ],
)
def test_a_value_outside_the_choices_is_one_line_naming_flag_and_value(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ChoiceError, match=message) as caught:
        _parse(*argv)
    assert caught.value.prog == "omnistage serve"
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"omnistage serve: error: {caught.value}"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--omni-dp-size-local", "-1"], "--omni-dp-size-local must be >= 0, got -1"),
        (["--headless", "--stage-id", "0", *M, "--omni-dp-size-local", "0"], "must be >= 1 with"),
        (["--headless", "--stage-id", "0", *M, "--omni-join", "h:1"], "--omni-join is for a head"),
        (["--omni-join", "nohost"], "--omni-join must be HOST:PORT"),
        (["--omni-join", "h:70000"], "--omni-join must be HOST:PORT"),
        (["--omni-heartbeat-timeout", "-3"], "--omni-heartbeat-timeout must be > 0, got -3"),
        (["--stage-init-timeout", "0"], "--stage-init-timeout must be > 0, got 0"),
        (["--omni-stage-wait-timeout", "0"], "--omni-stage-wait-timeout must be > 0, got 0"),
        (["--omni-restart-wait-timeout", "0"], "--omni-restart-wait-timeout must be > 0, got 0"),
        (["--drain-timeout", "-0.5"], "--drain-timeout must be >= 0, got -0.5"),
        (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1, got 0"),
        (["--api-server-count", "0"], "--api-server-count must be >= 1, got 0"),
        (["--realtime-max-sessions", "0"], "--realtime-max-sessions must be >= 1, got 0"),
        (["--realtime-idle-timeout", "0"], "--realtime-idle-timeout must be > 0, got 0"),
        (["--realtime-idle-timeout", "-2.5"], "--realtime-idle-timeout must be > 0, got -2.5"),
        (["--realtime-resume-ttl", "-1"], "--realtime-resume-ttl must be >= 0, got -1"),
        (["--media-fetch-timeout", "0"], "--media-fetch-timeout must be > 0, got 0"),
        (["--media-fetch-max-bytes", "0"], "--media-fetch-max-bytes must be >= 1, got 0"),
        (["--omni-master-port", "65536"], "--omni-master-port must be in 0..65535, got 65536"),
        (["--headless", "--stage-id", "0", *M, "--api-server-count", "2"], "is for the head"),
        (["--omni-heartbeat-timeout", "1.5"], "twice the heartbeat interval (2s), got 1.5"),
        (["--diffusers-load-kwargs", "[1]"], "--diffusers-load-kwargs must be a JSON object"),
        (["--model-class-name", "not a name"], "--model-class-name must be a Python class"),
        (["--max-generated-image-size", "100"], "--max-generated-image-size must be >= 4096"),
    ],
)
def test_validate_names_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError) as caught:
        validate(_parse(*argv))
    assert message in str(caught.value)


def test_validate_leaves_the_parsed_flags_alone() -> None:
    args = _parse("--omni-heartbeat-timeout", "90")
    before = copy.deepcopy(vars(args))
    flags = validate(args)
    assert vars(args) == before
    assert flags.omni_stall_timeout == 90.0
    assert {k: v for k, v in vars(flags).items() if k != "omni_stall_timeout"} == {
        k: v for k, v in before.items() if k != "omni_stall_timeout"
    }
    assert validate(_parse("--omni-stall-timeout", "0")).omni_stall_timeout == 0


def test_headless_options_carry_the_flags_and_the_stages_own_overrides() -> None:
    args = _parse(
        "--headless",
        "--stage-id",
        "1",
        *M,
        "--omni-dp-size-local",
        "2",
        "--stage-overrides",
        '{"0": {"replicas": 3}, "1": {"devices": "2,3"}}',
        "--vae-use-tiling",
        "--drain-timeout",
        "7",
        "-ora",
        "10.0.0.2",
    )
    opts = headless_options(validate(args))
    assert opts.dp_size_local == 2
    replica = opts.replica
    assert (replica.stage_id, replica.master_host, replica.master_port) == (1, "127.0.0.1", 1)
    assert (replica.advertise_address, replica.drain_timeout_s, replica.rejoin) == (
        "10.0.0.2",
        7.0,
        True,
    )
    assert replica.replica_id == -1  # the master assigns each one
    assert replica.stage_overrides == {"devices": "2,3", "engine_args": {"vae_use_tiling": True}}
    assert opts.replica_devices() == ["2", "3"]


def test_the_media_fetch_flags_reach_the_head() -> None:
    config = load_config("echo-1stage")
    plain = head_options(validate(_parse()), config)
    assert plain.allowed_media_domains == ()  # no fetching unless the operator allows it
    args = _parse(
        "--allowed-media-domains",
        "127.0.0.1",
        "example.com",
        "--media-fetch-timeout",
        "2.5",
        "--media-fetch-max-bytes",
        "1000",
    )
    opts = head_options(validate(args), config)
    assert opts.allowed_media_domains == ("127.0.0.1", "example.com")
    assert (opts.media_fetch_timeout_s, opts.media_fetch_max_bytes) == (2.5, 1000)


def test_the_realtime_limits_reach_the_head_and_its_api_servers() -> None:
    config = load_config("echo-1stage")
    plain = head_options(validate(_parse()), config)
    assert (plain.realtime_max_sessions, plain.realtime_idle_timeout_s) == (
        defaults.REALTIME_MAX_SESSIONS,
        defaults.REALTIME_IDLE_TIMEOUT_S,
    )
    assert plain.realtime_resume_ttl_s == defaults.REALTIME_RESUME_TTL_S
    args = _parse(
        "--realtime-max-sessions",
        "3",
        "--realtime-idle-timeout",
        "1.5",
        "--realtime-resume-ttl",
        "0",
    )
    opts = head_options(validate(args), config)
    assert (opts.realtime_max_sessions, opts.realtime_idle_timeout_s) == (3, 1.5)
    assert opts.realtime_resume_ttl_s == 0
    # What the head hands each API server process survives the trip through its env.
    server = ApiServerOptions(
        index=0,
        listen_fd=3,
        head_address="ipc://x",
        config={},
        started_at=0,
        realtime_max_sessions=opts.realtime_max_sessions,
        realtime_idle_timeout_s=opts.realtime_idle_timeout_s,
        realtime_resume_ttl_s=opts.realtime_resume_ttl_s,
    )
    back = decode_options(encode_options(server))
    assert (back.realtime_max_sessions, back.realtime_idle_timeout_s) == (3, 1.5)
    assert back.realtime_resume_ttl_s == 0
