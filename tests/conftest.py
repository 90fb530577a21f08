from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from support.procs import kill_all_started


def pytest_sessionfinish(session: object, exitstatus: int) -> None:
    kill_all_started()


# What the standard library runs for itself (ctypes.util.find_library asks ldconfig, or a
# compiler, on first use): not a process a test starts.
_STDLIB_PROBES = frozenset({"ldconfig", "gcc", "cc", "ld", "objdump", "uname"})


def _stdlib_probe(args: Any) -> bool:
    first = args[0] if isinstance(args, list | tuple) and args else args
    return isinstance(first, str) and Path(first).name in _STDLIB_PROBES


@pytest.fixture(autouse=True)
def _processes_only_when_marked(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keeps the `procs` marker true: a test without it that starts a process fails, so
    `pytest -m "not procs"` stays the fast loop it is documented to be."""
    if request.node.get_closest_marker("procs") is not None:
        return

    popen = subprocess.Popen.__init__

    def refuse(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        if _stdlib_probe(args):
            popen(self, args, *rest, **kwargs)
            return
        raise AssertionError(
            f"this test starts a process ({args!r}): mark its module "
            "`pytestmark = pytest.mark.procs`"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


@pytest.fixture
def upstream() -> Iterator[Any]:
    """The compiled front's tests' echoing upstream (`support/front_sockets.py`)."""
    from support.front_sockets import Upstream

    server = Upstream()
    try:
        yield server
    finally:
        server.close()
