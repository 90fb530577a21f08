"""The x86-64 wheel installs and runs where no Rust toolchain is, on every CPython its abi3
tag promises that this machine has (3.11, 3.12, 3.13).

Each interpreter gets a fresh venv in a folder outside the checkout, with a PATH that has
no cargo or rustc on it; the wheel (and its dependencies, from the package index) are
installed into it, and everything runs from that folder, so nothing can come from the source
tree: `sessiongate --version`, the import of every module of the package, the Rust core's
smoke check (`scripts/core_smoke.py`) and `sessiongate demo --quick`, which checks every
trajectory token-exact.

The wheel comes from `make wheel-x86_64` (`.ci/run` builds it before the tests); the
directory is `SESSIONGATE_WHEEL_DIR`, else `dist/` in the checkout. Without one the tests
skip, saying how to build it.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parents[2]
INTERPRETERS = ("3.11", "3.12", "3.13")
# Optional extras: modules that need them import them lazily, but say so if one does not.
OPTIONAL = ("ray", "matplotlib")
INSTALL_TIMEOUT = 600
RUN_TIMEOUT = 300


def wheel_path() -> Path:
    folder = Path(os.environ.get("SESSIONGATE_WHEEL_DIR", ROOT / "dist"))
    wheels = sorted(folder.glob("sessiongate-*-manylinux_*_x86_64.whl"))
    if not wheels:
        pytest.skip(f"no x86-64 manylinux wheel in {folder}: build one with `make wheel-x86_64`")
    return wheels[-1]


def interpreter(version: str) -> str | None:
    """A CPython `version` on PATH or under pyenv, else None."""
    found = shutil.which(f"python{version}")
    if found and "shims" not in found:
        return found
    pattern = str(Path.home() / ".pyenv" / "versions" / f"{version}.*" / "bin" / "python3")
    candidates = sorted(glob.glob(pattern))
    return candidates[-1] if candidates else found


def rust_free_path(venv: Path) -> str:
    """The venv's bin, then the system's, less every folder holding cargo or rustc."""
    folders = [str(venv / "bin"), "/usr/local/bin", "/usr/bin", "/bin"]
    return os.pathsep.join(
        f for f in folders if not any(Path(f, tool).exists() for tool in ("cargo", "rustc"))
    )


def run(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> str:
    done = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


IMPORT_ALL = f"""
import importlib, pkgutil, sys
import sessiongate
assert sessiongate.__file__.startswith(sys.prefix), sessiongate.__file__
walked = pkgutil.walk_packages(sessiongate.__path__, "sessiongate.")
names = [m.name for m in walked if not m.name.endswith(".__main__")]  # those run the CLI
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        if exc.name not in {OPTIONAL!r}:
            raise
print(len(names), "modules")
"""


@pytest.mark.parametrize("version", INTERPRETERS)
def test_the_wheel_runs_in_a_fresh_venv_without_rust(version: str, tmp_path: Path) -> None:
    wheel = wheel_path()
    python = interpreter(version)
    if python is None:
        pytest.skip(f"no CPython {version} on this machine (PATH or pyenv)")
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=INSTALL_TIMEOUT)
    env = {
        "PATH": rust_free_path(venv),
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "VIRTUAL_ENV": str(venv),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    assert shutil.which("cargo", path=env["PATH"]) is None
    assert shutil.which("rustc", path=env["PATH"]) is None
    bin_dir = venv / "bin"
    run([str(bin_dir / "pip"), "install", "-q", str(wheel)], tmp_path, env, INSTALL_TIMEOUT)

    version_line = run([str(bin_dir / "sessiongate"), "--version"], tmp_path, env, RUN_TIMEOUT)
    assert version_line.startswith("sessiongate ")
    assert "x86_64-unknown-linux-gnu, release" in version_line
    assert "modules" in run([str(bin_dir / "python"), "-c", IMPORT_ALL], tmp_path, env, RUN_TIMEOUT)
    smoke = shutil.copy(ROOT / "scripts" / "core_smoke.py", tmp_path / "core_smoke.py")
    assert "BAD" not in run([str(bin_dir / "python"), smoke], tmp_path, env, RUN_TIMEOUT)
    demo = run(
        [str(bin_dir / "sessiongate"), "demo", "--quick", "--progress", "off"],
        tmp_path,
        env,
        RUN_TIMEOUT,
    )
    assert "verified token-exact" in demo
    # The built-in tokenizer's data came with the wheel.
    data = run(
        [
            str(bin_dir / "python"),
            "-c",
            "import sessiongate.tokenizer as t, pathlib; "
            "print(sorted(p.name for p in (pathlib.Path(t.__file__).parent / 'data').iterdir()))",
        ],
        tmp_path,
        env,
        RUN_TIMEOUT,
    )
    assert "tokenizer.json" in data
