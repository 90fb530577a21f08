"""The configuration schema itself (no process): every option is one field with one flag,
the parsers are generated from it, the layers (defaults, environment, file, flags) apply in
order, and what a parent hands a child reads back equal."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from sessiongate.cli import build_parser
from sessiongate.config.cli import command_leaves, config_from_args
from sessiongate.config.engines import POLICIES, POLICY_TUNABLES, EngineRoutingConfig
from sessiongate.config.fields import ConfigError, flag_of
from sessiongate.config.gateway import SCHEMA_LEAVES, GatewayConfig, leaf_by_flag, value_at


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_every_option_has_one_flag_and_the_parsers_take_exactly_the_schemas() -> None:
    flags = [flag for leaf in SCHEMA_LEAVES for flag in leaf.option.every_flag]
    assert len(flags) == len(set(flags))
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("serve", "worker"):
        declared = {s for a in commands.choices[command]._actions for s in a.option_strings} - {
            "-h",
            "--help",
            "--config",
            "--print-config",
        }
        want = {flag for leaf in command_leaves(command) for flag in leaf.option.every_flag}
        assert declared == want, command


def test_every_policy_has_its_variant_and_every_tunable_a_policy() -> None:
    assert set(POLICY_TUNABLES) == set(POLICIES)
    tunables = {f.name for f in dataclasses.fields(EngineRoutingConfig)} - {"policy"}
    assert set().union(*POLICY_TUNABLES.values()) == tunables


def test_the_configuration_round_trips_through_json() -> None:
    args = parse(
        "serve", "--backend", "http://e:1", "--policy", "manual", "--session-header", "X-A",
        "--r3", "--r3-topk", "4", "--no-smg-routing-key", "--records-dir", "/tmp/r",
    )  # fmt: skip
    config = config_from_args(args, "serve")
    assert GatewayConfig.from_dict(config.to_dict()) == config
    assert config.engines.urls == ("http://e:1",)
    assert config.front.session_header == ("X-A",)
    assert config.sessions.smg_routing_key is False


def test_layers_apply_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built-in default < environment default < file < flag."""
    monkeypatch.setenv("SESSIONGATE_API_KEY", "from-env")
    assert config_from_args(parse("serve"), "serve").front.api_key == "from-env"
    path = tmp_path / "g.toml"
    path.write_text('[front]\napi_key = "from-file"\n[limits]\nmax_sessions = 3\n')
    config = config_from_args(parse("serve", "--config", str(path)), "serve")
    assert config.front.api_key == "from-file" and config.limits.max_sessions == 3
    config = config_from_args(
        parse("serve", "--config", str(path), "--api-key", "flag", "--max-sessions", "10000"),
        "serve",
    )
    # A flag given with its default value still wins over the file.
    assert config.front.api_key == "flag" and config.limits.max_sessions == 10000


def test_repeated_flags_replace_the_files_list(tmp_path: Path) -> None:
    path = tmp_path / "g.toml"
    path.write_text('[engines]\nurls = ["http://a:1", "http://b:1"]\n')
    from_file = config_from_args(parse("serve", "--config", str(path)), "serve")
    assert from_file.engines.urls == ("http://a:1", "http://b:1")
    flags = config_from_args(
        parse("serve", "--config", str(path), "--backend", "http://c:1"), "serve"
    )
    assert flags.engines.urls == ("http://c:1",)


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"engines": {"timeout": "slow"}}, "engines.timeout (--timeout) must be a number"),
        ({"sessions": {"r3": 1}}, "sessions.r3 (--r3) must be true or false"),
        ({"engines": {"urls": "http://a:1"}}, "engines.urls (--backend) must be a list"),
        ({"engines": {"routing": {"cache_threshold": -1.0}}}, "cache_threshold must be in"),
        ({"engines": {"reliability": {"retry_max_retries": 0}}}, "retry_max_retries must be"),
        ({"engines": 3}, "[engines] must be a table"),
        ({"sessionz": {}}, "unknown key 'sessionz'"),
    ],
)
def test_bad_values_name_their_key(data: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        GatewayConfig.from_dict(data)
    assert named in str(caught.value)


def test_messages_name_flags_from_their_declaration() -> None:
    assert flag_of(EngineRoutingConfig, "seed") == "--policy-seed"
    assert leaf_by_flag("--eviction-interval").path == (
        "engines",
        "routing",
        "eviction_interval_secs",
    )
    assert value_at(GatewayConfig(), leaf_by_flag("--policy")) == "cache_aware"
    with pytest.raises(KeyError):
        flag_of(EngineRoutingConfig, "nope")
