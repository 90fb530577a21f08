"""The gateway's one typed configuration: every option as a field of a section, with its
flag, default, help and validation (fields.py); the command lines generated from it
(cli.py); the TOML file and `--print-config` (files.py); and the hand-over to the
processes `serve` starts (launch.py). Import-light: no tokenizer, no core, no compiled code.
"""

from sessiongate.config.fields import ConfigError
from sessiongate.config.gateway import GatewayConfig

__all__ = ["ConfigError", "GatewayConfig"]
