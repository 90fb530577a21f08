"""The RL section: the control plane a trainer drives (smg's `/v1/rl` contract, behind
`--enable-rl`), the engines' labels it selects by, and what routing does while engines are
paused or at an older weight version (docs/routing.md, "RL control plane" and "Weight
versions and pauses").

The plane's flag names and defaults are smg 1.13's (`--enable-rl`,
`--rl-control-timeout-secs 600`, `--rl-fanout-concurrency 32`), so a trainer's launch line
carries over. The pause flags are sessiongate's: smg keeps routing to a paused engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sessiongate.config.fields import ONLY_SERVE, option, section

# A weight update takes seconds to minutes; the trainer's own control timeout is smg's 600 s,
# so a request held for a pause may wait as long as the update it waits for may take.
DEFAULT_PAUSE_WAIT_S = 600.0
DEFAULT_PAUSE_QUEUE = 4096


@section(title="RL control plane, weight versions and pauses (docs/routing.md)", key="rl")
@dataclass(frozen=True)
class RlConfig:
    enable_rl: bool = option(
        "--enable-rl",
        kind="switch",
        default=False,
        commands=ONLY_SERVE,
        help="serve smg's RL control plane under /v1/rl (engine discovery, one engine's "
        "control route, a selector fan-out), guarded by --admin-key like /workers",
    )
    control_timeout_secs: int = option(
        "--rl-control-timeout-secs",
        default=600,
        parse=int,
        commands=ONLY_SERVE,
        metavar="SECONDS",
        help="timeout of one control call passed to an engine through /v1/rl (600; a "
        "timeout is a 504 upstream_timeout)",
    )
    fanout_concurrency: int = option(
        "--rl-fanout-concurrency",
        default=32,
        parse=int,
        commands=ONLY_SERVE,
        metavar="N",
        help="engines called at once by one /v1/rl/engine fan-out (32)",
    )
    engine_labels: tuple[str, ...] = option(
        "--engine-label",
        kind="append",
        default=(),
        commands=ONLY_SERVE,
        metavar="[URL#]KEY=VALUE",
        help="a label of the --backend engines (every one, or the one named by URL#) that "
        "/v1/rl selectors match; registered engines take theirs from the registration's "
        '"labels"; repeat for several',
    )
    pause_queue_size: int = option(
        "--pause-queue-size",
        default=DEFAULT_PAUSE_QUEUE,
        parse=int,
        metavar="N",
        help="requests one gateway process holds while the engines they may use are paused "
        f"(or, with --newest-weights-only, behind); one more is a 503 ({DEFAULT_PAUSE_QUEUE})",
    )
    pause_wait_secs: float = option(
        "--pause-wait-secs",
        default=DEFAULT_PAUSE_WAIT_S,
        parse=float,
        metavar="SECONDS",
        help="how long a held request waits for an engine to continue before it is answered "
        f"503 ({DEFAULT_PAUSE_WAIT_S:g})",
    )
    newest_weights_only: bool = option(
        "--newest-weights-only",
        kind="switch",
        default=False,
        help="route new requests (and held families' turns) only to engines at the newest "
        "weight version while any engine is at it: the others wait as paused ones do",
    )

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem is not None:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """What is wrong with these values, or None."""
        if self.control_timeout_secs < 1:
            return f"rl control_timeout_secs must be >= 1, got {self.control_timeout_secs}"
        if self.fanout_concurrency < 1:
            return f"rl fanout_concurrency must be >= 1, got {self.fanout_concurrency}"
        if self.pause_queue_size < 0:
            return f"pause_queue_size must be >= 0, got {self.pause_queue_size}"
        if not (math.isfinite(self.pause_wait_secs) and self.pause_wait_secs > 0):
            return f"pause_wait_secs must be a finite number > 0, got {self.pause_wait_secs}"
        for label in self.engine_labels:
            problem = label_problem(label)
            if problem is not None:
                return problem
        return None


def split_label(text: str) -> tuple[str | None, str, str]:
    """`[URL#]KEY=VALUE` as (URL or None, KEY, VALUE); ValueError saying what is wrong."""
    problem = label_problem(text)
    if problem is not None:
        raise ValueError(problem)
    url, hashed, rest = text.rpartition("#")
    key, _, value = rest.partition("=")
    return (url if hashed else None), key.strip(), value.strip()


def label_problem(text: str) -> str | None:
    url, hashed, rest = text.rpartition("#")
    key, equals, _ = rest.partition("=")
    if not equals or not key.strip():
        return f"--engine-label {text!r} must be KEY=VALUE or URL#KEY=VALUE"
    if hashed and not url:
        return f"--engine-label {text!r}: the URL before '#' is empty"
    if any(c.isspace() or c in '=!,()"' for c in key.strip()):
        return f'--engine-label {text!r}: a key cannot hold spaces or any of = ! , ( ) "'
    return None
