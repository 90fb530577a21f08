"""Mode loading: configuration errors, entry-point plugins, `sessiongate plugins`."""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

import pytest

from sessiongate.session_routing import (
    ENTRY_POINT_GROUP,
    DynamoNvext,
    RoutingConfigError,
    RoutingContext,
    available_mode_names,
    list_modes,
    load_mode,
)
from sessiongate.session_routing import cli as routing_cli

FIXTURE = Path(__file__).parent / "routing_plugin_fixture"
BUILTINS = "dynamo_headers, dynamo_nvext, identity_headers, session_id_header, smg_routing_key"
CTX = RoutingContext("c", "r", "r", is_final_turn=False, is_parent_final=False)


def load_error(name: str | None, *options: str) -> str:
    with pytest.raises(RoutingConfigError) as info:
        load_mode(name, list(options))
    return str(info.value)


# -- built-ins and configuration errors ----------------------------------------------------


def test_no_mode_means_no_routing():
    assert load_mode(None, []) is None
    assert load_mode("  ", []) is None


def test_options_without_a_mode():
    msg = load_error(None, "timeout_seconds=5")
    assert msg == (
        "--session-routing-opt given without --session-routing; choose a mode (one of: "
        f"{BUILTINS}) or drop the options"
    )


def test_unknown_mode_lists_the_available_ones():
    msg = load_error("dynamo_header")
    assert msg == (
        "unknown session routing mode 'dynamo_header' (did you mean 'dynamo_headers'?); "
        f"available modes: {BUILTINS} (run `sessiongate plugins` for their options)"
    )
    assert "did you mean" not in load_error("zzz")


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (
            "timeout_seconds",
            "malformed --session-routing-opt 'timeout_seconds': expected key=value",
        ),
        ("=5", "malformed --session-routing-opt '=5': the key before '=' is empty"),
        ("", "empty --session-routing-opt; expected key=value"),
        ("   ", "empty --session-routing-opt; expected key=value"),
    ],
)
def test_malformed_options(option, message):
    assert load_error("dynamo_nvext", option).startswith(message)


def test_duplicate_option():
    msg = load_error("dynamo_nvext", "timeout_seconds=5", " timeout_seconds = 6")
    assert msg == (
        "--session-routing-opt 'timeout_seconds' is given twice "
        "(timeout_seconds='5' and timeout_seconds='6'); keep one"
    )


def test_unknown_option_lists_valid_keys():
    assert load_error("dynamo_nvext", "timeout=5") == (
        "unknown option 'timeout' for session routing mode 'dynamo_nvext'; "
        "valid options: timeout_seconds"
    )
    assert load_error("identity_headers", "sessions=X-A") == (
        "unknown option 'sessions' for session routing mode 'identity_headers'; "
        "valid options: session, parent, root"
    )
    assert load_error("dynamo_headers", "x=1") == (
        "unknown option 'x' for session routing mode 'dynamo_headers'; this mode takes no options"
    )


@pytest.mark.parametrize(
    ("mode", "option", "message"),
    [
        (
            "dynamo_nvext",
            "timeout_seconds=0",
            "invalid options for session routing mode 'dynamo_nvext': timeout_seconds='0': "
            "Input should be greater than or equal to 1",
        ),
        (
            "dynamo_nvext",
            "timeout_seconds=soon",
            "invalid options for session routing mode 'dynamo_nvext': timeout_seconds='soon': "
            "Input should be a valid integer, unable to parse string as an integer",
        ),
        (
            "session_id_header",
            "header_name=X Session",
            "invalid options for session routing mode 'session_id_header': "
            "header_name='X Session': header name 'X Session' is not an RFC 9110 token "
            "(offending characters: ' '); use letters, digits and !#$%&'*+-.^_`|~ only",
        ),
        (
            "identity_headers",
            "root=",
            "invalid options for session routing mode 'identity_headers': identity_headers "
            "needs at least one header name: set session=, parent= and/or root= "
            "(e.g. session=X-Session-ID)",
        ),
        (
            "identity_headers",
            "session=X-Key,X-Other",
            None,  # valid: checked below
        ),
    ],
)
def test_invalid_values_read_well(mode, option, message):
    if message is None:
        assert load_mode(mode, [option]) is not None
    else:
        assert load_error(mode, option) == message


def test_identity_headers_collision_across_tiers_is_a_config_error():
    msg = load_error("identity_headers", "session=X-Key", "root=x-key")
    assert "header name 'x-key' appears in session and root" in msg
    assert "compared case-insensitively" in msg


def test_builtin_modes_load_with_options():
    mode = load_mode("dynamo_nvext", ["timeout_seconds=42"])
    assert isinstance(mode, DynamoNvext)
    assert mode.transform_body({}, CTX)["nvext"]["session_control"]["timeout"] == 42
    mode = load_mode("identity_headers", ["session= X-S , X-K", "parent=X-P", "root=X-R"])
    assert mode is not None
    assert mode.headers(CTX) == {"X-S": "c", "X-K": "c", "X-P": "r", "X-R": "r"}
    mode = load_mode("session_id_header", ["header_name=X-Correlation-ID"])
    assert mode is not None and mode.headers(CTX) == {"X-Correlation-ID": "c"}
    assert load_mode(" smg_routing_key ", []).headers(CTX) == {"X-SMG-Routing-Key": "c"}


# -- entry-point plugins -------------------------------------------------------------------


def fake_dist(root: Path, name: str, entry_points: dict[str, str], version: str = "0.1.0") -> None:
    """Write `<name>-<version>.dist-info` so importlib.metadata sees an installed package."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = [f"[{ENTRY_POINT_GROUP}]", *(f"{k} = {v}" for k, v in entry_points.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    """The fixture package importable, and a site dir where tests install fake dists."""
    monkeypatch.syspath_prepend(str(FIXTURE / "src"))
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    yield site
    for mod in [m for m in sys.modules if m.startswith("sg_routing_fixture")]:
        del sys.modules[mod]


@pytest.fixture
def installed_fixture(plugin_path):
    """Install the fixture plugin with exactly the entry points its pyproject declares."""
    project = tomllib.loads((FIXTURE / "pyproject.toml").read_text())["project"]
    fake_dist(
        plugin_path,
        project["name"],
        project["entry-points"][ENTRY_POINT_GROUP],
        version=project["version"],
    )
    return plugin_path


def test_plugin_is_discovered_listed_and_loaded(installed_fixture):
    assert "fixture_trace" in available_mode_names()
    info = {m.name: m for m in list_modes()}["fixture_trace"]
    assert info.error is None
    assert info.source == "sg-routing-fixture 0.1.0 (sg_routing_fixture:TraceHeader)"
    assert [(o.name, o.type, o.default) for o in info.options] == [
        ("prefix", "str", ""),
        ("upper", "bool", False),
    ]
    mode = load_mode("fixture_trace", ["prefix=t:", "upper=true"])
    assert mode is not None and mode.mutates_body is False
    assert mode.headers(CTX) == {"X-Fixture-Trace": "T:R/C"}
    mode.on_session_end("c")
    assert mode.ended == ["c"]  # type: ignore[attr-defined]
    assert "valid options: prefix, upper" in load_error("fixture_trace", "suffix=x")
    assert "upper='maybe': Input should be a valid boolean" in load_error(
        "fixture_trace", "upper=maybe"
    )


def test_broken_plugin_names_its_entry_point(plugin_path):
    fake_dist(plugin_path, "sg-broken", {"fixture_broken": "sg_routing_fixture.broken:Mode"})
    msg = load_error("fixture_broken")
    assert msg == (
        "routing plugin entry point 'fixture_broken = sg_routing_fixture.broken:Mode' from "
        "sg-broken 0.1.0 (sg_routing_fixture.broken:Mode) failed to load: ImportError: "
        "sg_routing_fixture.broken needs the 'frobnicate' package; fix or uninstall that "
        "plugin, or choose another mode"
    )
    # Built-ins keep working, and the listing shows the broken plugin instead of crashing.
    assert load_mode("smg_routing_key", []) is not None
    broken = {m.name: m for m in list_modes()}["fixture_broken"]
    assert broken.error == msg


@pytest.mark.parametrize(
    ("target", "fragment"),
    [
        (
            "sg_routing_fixture.bad:LyingMode",
            "overrides transform_body but declares mutates_body = False, so the gateway would "
            "never call it; set mutates_body = True",
        ),
        (
            "sg_routing_fixture.bad:ClaimsBodyMode",
            "declares mutates_body = True but does not override transform_body; "
            "set mutates_body = False",
        ),
        (
            "sg_routing_fixture.bad:LaxOptionsMode",
            "Options must set model_config = ConfigDict(extra='forbid', frozen=True)",
        ),
        ("sg_routing_fixture.bad:NoHeadersMode", "does not implement headers"),
        (
            "sg_routing_fixture.bad:NOT_A_MODE",
            "must be a subclass of sessiongate.session_routing.SessionRoutingMode",
        ),
        ("sg_routing_fixture:TraceHeader", "make the entry point name and the class's `name`"),
    ],
)
def test_contract_violations_are_refused(plugin_path, target, fragment):
    # Entry point names match the classes' `name` except where the mismatch is the point.
    attr = target.rsplit(":", 1)[1]
    name = {
        "LyingMode": "fixture_lying",
        "ClaimsBodyMode": "fixture_claims_body",
        "LaxOptionsMode": "fixture_lax",
        "NoHeadersMode": "fixture_no_headers",
    }.get(attr, attr.lower())
    fake_dist(plugin_path, "sg-bad", {name: target})
    msg = load_error(name)
    assert msg.startswith(f"routing plugin entry point '{name} = {target}' from sg-bad 0.1.0")
    assert "is not a valid routing mode" in msg
    assert fragment in msg


def test_plugin_cannot_shadow_a_builtin(plugin_path):
    fake_dist(plugin_path, "sg-shadow", {"dynamo_headers": "sg_routing_fixture:TraceHeader"})
    assert "shadows the built-in mode of the same name" in load_error("dynamo_headers")


def test_reregistering_a_builtin_class_is_harmless(plugin_path):
    # What sessiongate's own pyproject would do if it listed the built-ins in the group.
    fake_dist(
        plugin_path,
        "sessiongate-dup",
        {"dynamo_nvext": "sessiongate.session_routing.modes:DynamoNvext"},
    )
    assert isinstance(load_mode("dynamo_nvext", []), DynamoNvext)
    assert [m.name for m in list_modes()].count("dynamo_nvext") == 1


def test_two_distributions_claiming_one_name(installed_fixture):
    fake_dist(installed_fixture, "sg-other", {"fixture_trace": "sg_routing_fixture.bad:LyingMode"})
    msg = load_error("fixture_trace")
    assert "is provided by sg-routing-fixture 0.1.0" in msg
    assert "sg-other 0.1.0" in msg and msg.endswith("uninstall one of them")


# -- `sessiongate plugins` -----------------------------------------------------------------


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="sessiongate")
    routing_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plugins", *argv])
    return args.run(args)


def test_plugins_json(installed_fixture, capsys):
    assert run_cli("--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["entry_point_group"] == "sessiongate.session_routing"
    modes = {m["name"]: m for m in doc["modes"]}
    assert set(modes) >= {*BUILTINS.split(", "), "fixture_trace"}
    assert modes["dynamo_nvext"]["mutates_body"] is True
    assert modes["dynamo_nvext"]["options"] == [
        {
            "name": "timeout_seconds",
            "type": "int >= 1",
            "default": 300,
            "required": False,
            "description": "session_control timeout sent with every bind (seconds, >= 1)",
        }
    ]
    assert modes["identity_headers"]["options"][0]["default"] == []
    assert modes["session_id_header"]["options"][0]["default"] == "X-Session-ID"


def test_plugins_table_and_broken_exit_code(plugin_path, capsys):
    assert run_cli() == 0
    out = capsys.readouterr().out
    for name in [*BUILTINS.split(", "), "timeout_seconds", "X-Session-ID", "list[str]"]:
        assert name in out
    fake_dist(plugin_path, "sg-broken", {"fixture_broken": "sg_routing_fixture.broken:Mode"})
    assert run_cli() == 1
    assert "broken plugin" in capsys.readouterr().out
    assert run_cli("--json") == 1
    modes = {m["name"]: m for m in json.loads(capsys.readouterr().out)["modes"]}
    assert "frobnicate" in modes["fixture_broken"]["error"]
