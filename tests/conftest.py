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


@pytest.fixture(autouse=True)
def _processes_only_when_marked(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keeps the `procs` marker true: a test without it that starts a process fails, so
    `pytest -m "not procs"` stays the fast loop it is documented to be."""
    if request.node.get_closest_marker("procs") is not None:
        return

    def refuse(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
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
