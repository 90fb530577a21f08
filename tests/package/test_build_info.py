"""Which build answered: `sessiongate --version` and `/metrics`' `sessiongate_build_info`
name the package version and the Rust core's build (build.rs, rust/build_info.rs)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sessiongate import __version__, _core
from sessiongate.build import build_labels
from sessiongate.gateway.metrics import RouterMetrics

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs


def test_the_core_reports_its_build() -> None:
    info = _core.build_info()
    assert set(info) == {"version", "target", "profile", "rustc"}
    assert info["version"] == _core.__version__
    assert info["profile"] in ("release", "debug")
    assert info["rustc"].startswith("rustc ")
    assert "-" in info["target"]  # a target triple


def test_version_names_the_package_and_the_core() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sessiongate", "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    info = _core.build_info()
    assert out == (
        f"sessiongate {__version__} (core {info['version']}, {info['target']}, "
        f"{info['profile']}, {info['rustc']})\n"
    )


def test_metrics_carry_the_build_info() -> None:
    text = RouterMetrics().render([]).decode()
    labels = build_labels()
    line = next(x for x in text.splitlines() if x.startswith("sessiongate_build_info{"))
    for name, value in labels.items():
        assert f'{name}="{value}"' in line
    assert line.endswith("} 1")
    assert "# TYPE sessiongate_build_info gauge" in text
