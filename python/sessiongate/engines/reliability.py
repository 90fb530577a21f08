"""Engine-facing reliability: health thresholds, retries with backoff, a circuit breaker per
engine. The specification of what `rust/front/reliability.rs` decides (twin-tested in
`tests/engines/test_reliability_twin.py`), and what the Python upstream pool uses itself.

The options are `ReliabilityConfig` (config/engines.py), with the SGLang Model Gateway's
names and defaults (sglang-router 0.3.2); what each means here is in docs/reliability.md,
"Engine-facing retries and the circuit breaker". Nothing here reads a clock: every
decision takes `now` (seconds, any monotonic origin), so tests drive it with a fake clock.
"""

from __future__ import annotations

import math

from sessiongate.config.engines import ReliabilityConfig

# Replies that say the engine refused the request before doing any work: safe to send again.
RETRYABLE_STATUSES = frozenset({429, 503})

CLOSED = 0
OPEN = 1
HALF_OPEN = 2
STATE_NAMES = {CLOSED: "closed", OPEN: "open", HALF_OPEN: "half_open"}


def new_breaker(config: ReliabilityConfig) -> CircuitBreaker:
    """A circuit breaker per engine, as `config` sets it."""
    return CircuitBreaker(
        config.cb_failure_threshold,
        config.cb_success_threshold,
        config.cb_timeout_duration_secs,
        config.cb_window_duration_secs,
        disabled=config.disable_circuit_breaker,
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
