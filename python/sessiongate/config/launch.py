"""How `serve` hands its children their configuration: the resolved `GatewayConfig` whole,
with what only that child needs (its channel's descriptor, its index, the router's worker
endpoints), as one JSON document in the child's environment. Children parse no flags, so
nothing is re-serialised to argv and parsed again; and the environment, unlike argv, does
not show secrets in `ps`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from sessiongate.config.gateway import GatewayConfig

# The variable a child reads its launch document from.
LAUNCH_ENV = "SESSIONGATE_LAUNCH"


@dataclass(frozen=True)
class WorkerLaunch:
    """A worker process `serve` starts (`sessiongate _worker`), itself or through Ray."""

    config: GatewayConfig
    # The channel socket to the router, inherited; None: listen on TCP as `sessiongate
    # worker` does, at `config.workers.listen` (a Ray actor's worker).
    fd: int | None
    index: int
    generation: int = 0
    # Where bulk replies go as files for the router (dataplane/transport/reply_files.py);
    # None: frames only.
    reply_dir: str | None = None


@dataclass(frozen=True)
class RouterLaunch:
    """The router process (`sessiongate _router`)."""

    config: GatewayConfig
    port: int
    control_fd: int
    worker_fds: tuple[int, ...] = ()
    # Remote workers (HOST:PORT), when they are not this machine's children.
    worker_endpoints: tuple[str, ...] = ()
    # Where the remote workers' shared secret is: a file, or a variable of this environment.
    secret_file: str | None = None
    secret_env: str | None = None
    # The start-up engine is the embedded mock, which the first registration replaces.
    engines_placeholder: bool = False
    # The directory of its workers' file replies (see WorkerLaunch); None: none accepted.
    reply_dir: str | None = None


def launch_env(launch: WorkerLaunch | RouterLaunch) -> dict[str, str]:
    """The environment entry that carries `launch` to the child."""
    values = {name: getattr(launch, name) for name in launch.__dataclass_fields__}
    values["config"] = launch.config.to_dict()
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
    return {LAUNCH_ENV: json.dumps(values, separators=(",", ":"))}


def read_launch(kind: type[WorkerLaunch] | type[RouterLaunch]) -> Any:
    """This process's launch document (SystemExit when it is missing or broken: these
    commands are started by `serve`, not by hand)."""
    text = os.environ.get(LAUNCH_ENV)
    if not text:
        raise SystemExit(f"{LAUNCH_ENV} is not set: this command is started by `sessiongate serve`")
    try:
        values = json.loads(text)
        config = GatewayConfig.from_dict(values.pop("config"), where=LAUNCH_ENV)
        tuples: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in values.items()
        }
        return kind(config=config, **tuples)
    except (ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"{LAUNCH_ENV} cannot be read: {exc}") from None
