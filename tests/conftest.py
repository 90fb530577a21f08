from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from procs import kill_all_started


def pytest_sessionfinish(session: object, exitstatus: int) -> None:
    kill_all_started()


@pytest.fixture
def upstream() -> Iterator[Any]:
    """The compiled front's tests' echoing upstream (`test_compiled_front_unit.Upstream`)."""
    from test_compiled_front_unit import Upstream

    server = Upstream()
    try:
        yield server
    finally:
        server.close()
