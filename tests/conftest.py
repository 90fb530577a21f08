from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from procs import kill_all_started


def pytest_sessionfinish(session: object, exitstatus: int) -> None:
    kill_all_started()
