"""The configuration file (`--config FILE`, TOML) and `--print-config`'s rendering of the
effective configuration in the same format, so its output is a valid file to start from."""

from __future__ import annotations

import json
import tomllib
from typing import Any

from sessiongate.config.engines import POLICY_TUNABLES
from sessiongate.config.fields import ConfigError, leaves, section_types
from sessiongate.config.gateway import GatewayConfig, value_at


def read_config_file(path: str) -> dict[str, Any]:
    """The file's tables (ConfigError when it cannot be read or is not TOML)."""
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None


def render_toml(config: GatewayConfig, command: str) -> str:
    """The options of `command` with their effective values, one table per section. Unset
    options are comments; secrets say only whether they are set."""
    lines = [f"# sessiongate {command}: the effective configuration"]
    _render_section(lines, config, GatewayConfig, (), command)
    return "\n".join(lines) + "\n"


def _render_section(
    lines: list[str], config: GatewayConfig, cls: type, path: tuple[str, ...], command: str
) -> None:
    own = [leaf for leaf in leaves(cls, path) if len(leaf.path) == len(path) + 1]
    own = [leaf for leaf in own if command in leaf.option.commands and not leaf.option.hidden]
    if path == ("engines", "routing"):
        # The chosen policy's variant: its name and the tunables it reads.
        reads = POLICY_TUNABLES.get(config.engines.routing.policy, ())
        own = [leaf for leaf in own if leaf.path[-1] == "policy" or leaf.path[-1] in reads]
    if own and path:
        lines += ["", f"[{'.'.join(path)}]"]
    for leaf in own:
        value = value_at(config, leaf)
        name = leaf.path[-1]
        if leaf.option.secret:
            lines.append(f"# {name}: {'set' if value else 'not set'} ({leaf.option.flag})")
        elif value is None:
            lines.append(f"# {name} = (not set; {leaf.option.flag})")
        else:
            lines.append(f"{name} = {_toml_value(value)}")
    for name, _, kind in section_types(cls):
        _render_section(lines, config, kind, (*path, name), command)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    # A JSON string is a valid TOML basic string for everything a flag value holds.
    return json.dumps(str(value), ensure_ascii=False)
