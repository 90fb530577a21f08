"""The compiled front's retry backoff and circuit breaker (rust/front/reliability.rs) equal
their specification (engines/reliability.py): generated schedules and generated
sequences of outcomes on a generated clock get the same answers from both."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate._core import FrontCircuitBreaker, FrontHealthCounter, front_backoff_ms
from sessiongate.engines.reliability import CircuitBreaker, HealthCounter, backoff_ms

# Within what the flags take in practice and f64 represents exactly (below 2**53 ms).
millis = st.integers(min_value=0, max_value=2**40)
multipliers = st.floats(min_value=1.0, max_value=10.0, allow_nan=False)
ratios = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
samples = st.floats(min_value=-1.0, max_value=1.0, allow_nan=False)


@settings(max_examples=2000, deadline=None)
@given(st.integers(0, 200), millis, millis, multipliers, ratios, samples)
def test_backoff_twin(
    attempt: int, initial: int, cap: int, multiplier: float, jitter: float, sample: float
) -> None:
    want = backoff_ms(attempt, initial, cap, multiplier, jitter, sample)
    assert front_backoff_ms(attempt, initial, cap, multiplier, jitter, sample) == want


steps = st.lists(
    st.tuples(
        st.sampled_from(["success", "failure", "state", "allows"]),
        st.floats(min_value=0.0, max_value=30.0, allow_nan=False),
    ),
    max_size=80,
)


@settings(max_examples=1000, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 4),
    st.floats(min_value=0.5, max_value=20.0),
    st.floats(min_value=0.5, max_value=40.0),
    st.booleans(),
    steps,
)
def test_breaker_twin(
    failures: int,
    successes: int,
    timeout: float,
    window: float,
    disabled: bool,
    script: list[tuple[str, float]],
) -> None:
    spec = CircuitBreaker(failures, successes, timeout, window, disabled=disabled)
    twin = FrontCircuitBreaker(failures, successes, timeout, window, disabled)
    now = 0.0
    for action, step in script:
        now += step  # a monotonic clock
        if action == "state":
            assert twin.state(now) == spec.state(now)
        elif action == "allows":
            assert twin.allows(now) == spec.allows(now)
        else:
            success = action == "success"
            assert twin.record(success, now) == spec.record(success, now)
    assert twin.opened == spec.opened


@settings(max_examples=500, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(1, 5),
    st.lists(st.sampled_from(["pass", "fail", "reset", "flip"]), max_size=60),
)
def test_health_counter_twin(failures: int, successes: int, script: list[str]) -> None:
    spec = HealthCounter(failures, successes)
    twin = FrontHealthCounter(failures, successes)
    healthy = True
    for step in script:
        if step == "reset":
            spec.reset()
            twin.reset()
        elif step == "flip":  # a real request decided the health meanwhile
            healthy = not healthy
        else:
            want = spec.probe(step == "pass", healthy)
            assert twin.probe(step == "pass", healthy) == want
            healthy = want
