"""Starting and stopping sessiongate's own child processes."""

from sessiongate.process.children import (
    ChildProcess,
    free_port,
    listen_problem,
    wait_http_ready,
)

__all__ = ["ChildProcess", "free_port", "listen_problem", "wait_http_ready"]
