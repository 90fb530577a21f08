"""Engine-facing reliability: health thresholds, retries with backoff, a circuit breaker per
engine. The specification of what `rust/front/reliability.rs` decides (twin-tested in
`tests/primitives/test_reliability_twin.py`), and what the Python upstream pool uses itself.

Flag names and defaults are the SGLang Model Gateway's (sglang-router 0.3.2); what each
means here is in docs/reliability.md, "Engine-facing retries and the circuit breaker".
Nothing here reads a clock: every decision takes `now` (seconds, any monotonic origin), so
tests drive it with a fake clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Replies that say the engine refused the request before doing any work: safe to send again.
RETRYABLE_STATUSES = frozenset({429, 503})

CLOSED = 0
OPEN = 1
HALF_OPEN = 2
STATE_NAMES = {CLOSED: "closed", OPEN: "open", HALF_OPEN: "half_open"}


@dataclass(frozen=True)
class ReliabilityConfig:
    """Health thresholds, retries and the circuit breaker (docs/reliability.md)."""

    # Consecutive failed probes before an engine is marked down; consecutive passed probes
    # before a down engine is up again.
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    health_check_timeout_secs: float = 5.0
    health_check_endpoint: str = "/health"
    # Attempts in all (the Gateway's meaning of its "max retries"): 5 = 1 try + 4 retries.
    retry_max_retries: int = 5
    retry_initial_backoff_ms: int = 50
    retry_max_backoff_ms: int = 30_000
    retry_backoff_multiplier: float = 1.5
    retry_jitter_factor: float = 0.2
    disable_retries: bool = False
    # Failures (transport errors, 5xx replies) in a row, within the window, that open the
    # breaker; trial successes that close it again; seconds it stays open.
    cb_failure_threshold: int = 10
    cb_success_threshold: int = 3
    cb_timeout_duration_secs: float = 60.0
    cb_window_duration_secs: float = 120.0
    disable_circuit_breaker: bool = False

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem is not None:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """What is wrong with these values, or None."""
        for name in (
            "health_failure_threshold",
            "health_success_threshold",
            "retry_max_retries",
            "cb_failure_threshold",
            "cb_success_threshold",
        ):
            if getattr(self, name) < 1:
                return f"{name} must be >= 1, got {getattr(self, name)}"
        for name in ("retry_initial_backoff_ms", "retry_max_backoff_ms"):
            if getattr(self, name) < 0:
                return f"{name} must be >= 0, got {getattr(self, name)}"
        for name in (
            "health_check_timeout_secs",
            "cb_timeout_duration_secs",
            "cb_window_duration_secs",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                return f"{name} must be a number > 0, got {value}"
        multiplier = self.retry_backoff_multiplier
        if not (math.isfinite(multiplier) and multiplier >= 1.0):
            return f"retry_backoff_multiplier must be a number >= 1, got {multiplier}"
        if not 0.0 <= self.retry_jitter_factor <= 1.0:
            return f"retry_jitter_factor must be in [0, 1], got {self.retry_jitter_factor}"
        if not self.health_check_endpoint.startswith("/"):
            return f"health_check_endpoint must start with '/', got {self.health_check_endpoint!r}"
        return None

    @property
    def attempts(self) -> int:
        """How many times one request may be sent (1 with retries off)."""
        return 1 if self.disable_retries else self.retry_max_retries

    def breaker(self) -> CircuitBreaker:
        return CircuitBreaker(
            self.cb_failure_threshold,
            self.cb_success_threshold,
            self.cb_timeout_duration_secs,
            self.cb_window_duration_secs,
            disabled=self.disable_circuit_breaker,
        )


def backoff_ms(
    attempt: int,
    initial_ms: int,
    max_ms: int,
    multiplier: float,
    jitter: float,
    sample: float,
) -> int:
    """Milliseconds to wait after failed attempt `attempt` (0-based) before the next one:
    `min(initial * multiplier**attempt, max)`, moved by `jitter * sample` of itself, where
    `sample` in [-1, 1] is the caller's random draw (injected, so the schedule is testable).
    The power is repeated multiplication, stopped at the cap, so the twin gets the same
    float bits; rounding is half away from zero, as Rust's `f64::round`."""
    delay = float(initial_ms)
    for _ in range(attempt):
        if delay >= max_ms:
            break
        delay *= multiplier
    base = max_ms if delay >= max_ms else int(delay)
    sample = min(1.0, max(-1.0, sample))
    moved = base * jitter * sample
    shift = math.floor(abs(moved) + 0.5)
    return max(0, base + (shift if moved >= 0 else -shift))


class CircuitBreaker:
    """One engine's breaker. Closed: requests pass, failures in a row are counted (a streak
    whose first failure is older than the window starts over); at the threshold it opens.
    Open: the engine takes no requests until the timeout has passed, then half-open. Half-
    open: requests pass as trials; the success threshold of them in a row closes it, one
    failure opens it again. Disabled, it always stays closed."""

    def __init__(
        self,
        failure_threshold: int = 10,
        success_threshold: int = 3,
        timeout_secs: float = 60.0,
        window_secs: float = 120.0,
        *,
        disabled: bool = False,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.timeout_secs = timeout_secs
        self.window_secs = window_secs
        self.disabled = disabled
        self._state = CLOSED
        self.failures = 0
        self.successes = 0
        self._streak_start = 0.0
        self._opened_at = 0.0
        # Times it opened (a counter for /metrics).
        self.opened = 0

    def state(self, now: float) -> int:
        """CLOSED, OPEN or HALF_OPEN at `now` (an open breaker past its timeout half-opens)."""
        if self._state == OPEN and now - self._opened_at >= self.timeout_secs:
            self._state = HALF_OPEN
            self.failures = 0
            self.successes = 0
        return self._state

    def allows(self, now: float) -> bool:
        return self.state(now) != OPEN

    def record(self, success: bool, now: float) -> int:
        """Count one request's outcome; the state after it."""
        if self.disabled:
            return CLOSED
        state = self.state(now)
        if success:
            self.failures = 0
            self.successes += 1
            if state == HALF_OPEN and self.successes >= self.success_threshold:
                self._state = CLOSED
                self.successes = 0
            return self._state
        self.successes = 0
        if self.failures == 0 or now - self._streak_start > self.window_secs:
            self.failures = 0
            self._streak_start = now
        self.failures += 1
        if state == HALF_OPEN or (state == CLOSED and self.failures >= self.failure_threshold):
            self._state = OPEN
            self._opened_at = now
            self.failures = 0
            self.opened += 1
        return self._state


class HealthCounter:
    """Consecutive probe results of one engine: the probe's verdict flips the engine's
    health only after `failures` failed probes in a row (down) or `successes` passed ones
    in a row (up again)."""

    def __init__(self, failures: int = 3, successes: int = 2) -> None:
        self.failure_threshold = failures
        self.success_threshold = successes
        self.failed = 0
        self.passed = 0

    def probe(self, passed: bool, healthy: bool) -> bool:
        """The engine's health after one probe, given its health before it."""
        if passed:
            self.failed = 0
            self.passed += 1
            return healthy or self.passed >= self.success_threshold
        self.passed = 0
        self.failed += 1
        return healthy and self.failed < self.failure_threshold

    def reset(self) -> None:
        """The engine's health was set by a real request: count probes from here."""
        self.failed = 0
        self.passed = 0
