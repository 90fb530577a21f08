//! Engine-facing reliability of the front's relay: the retry backoff schedule, a circuit
//! breaker per engine and the health probes' thresholds. The twin of
//! `python/sessiongate/engines/reliability.py` (`tests/engines/test_reliability_twin.py`);
//! no clock is read here: every decision takes `now` in seconds.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use serde::de::IgnoredAny;
use serde::Deserialize;

use crate::options::from_py_dict;

pub const CLOSED: u8 = 0;
pub const OPEN: u8 = 1;
pub const HALF_OPEN: u8 = 2;

pub fn state_name(state: u8) -> &'static str {
    match state {
        OPEN => "open",
        HALF_OPEN => "half_open",
        _ => "closed",
    }
}

/// Replies that say the engine refused the request before doing any work.
pub fn retryable_status(status: u16) -> bool {
    status == 429 || status == 503
}

/// `ReliabilityConfig` of the Python side (its defaults are the Gateway's), read by
/// `crate::options`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub health_failure_threshold: u32,
    pub health_success_threshold: u32,
    pub health_check_timeout_secs: f64,
    /// The front takes its probe path as its own argument.
    health_check_endpoint: IgnoredAny,
    pub retry_max_retries: u32,
    pub retry_initial_backoff_ms: u64,
    pub retry_max_backoff_ms: u64,
    pub retry_backoff_multiplier: f64,
    pub retry_jitter_factor: f64,
    pub disable_retries: bool,
    pub cb_failure_threshold: u32,
    pub cb_success_threshold: u32,
    pub cb_timeout_duration_secs: f64,
    pub cb_window_duration_secs: f64,
    pub disable_circuit_breaker: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            health_failure_threshold: 3,
            health_success_threshold: 2,
            health_check_timeout_secs: 5.0,
            health_check_endpoint: IgnoredAny,
            retry_max_retries: 5,
            retry_initial_backoff_ms: 50,
            retry_max_backoff_ms: 30_000,
            retry_backoff_multiplier: 1.5,
            retry_jitter_factor: 0.2,
            disable_retries: false,
            cb_failure_threshold: 10,
            cb_success_threshold: 3,
            cb_timeout_duration_secs: 60.0,
            cb_window_duration_secs: 120.0,
            disable_circuit_breaker: false,
        }
    }
}

impl Config {
    /// From `dataclasses.asdict(ReliabilityConfig(...))` (None: the defaults); the Python
    /// side validated the values, this only refuses what Rust cannot represent.
    pub fn from_dict(dict: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let config: Self = from_py_dict("reliability options", dict)?;
        config.check().map_err(PyValueError::new_err)?;
        Ok(config)
    }

    /// What is wrong with these values (in the words of the former dict reader), or Ok.
    fn check(&self) -> Result<(), String> {
        let bad = |key: &str, what: &str, value: &dyn std::fmt::Display| {
            Err(format!("{key} must be {what}, got {value}"))
        };
        for (key, value) in [
            ("health_failure_threshold", self.health_failure_threshold),
            ("health_success_threshold", self.health_success_threshold),
            ("retry_max_retries", self.retry_max_retries),
            ("cb_failure_threshold", self.cb_failure_threshold),
            ("cb_success_threshold", self.cb_success_threshold),
        ] {
            if value < 1 {
                return bad(key, "an integer >= 1", &value);
            }
        }
        for (key, value) in [
            ("health_check_timeout_secs", self.health_check_timeout_secs),
            ("cb_timeout_duration_secs", self.cb_timeout_duration_secs),
            ("cb_window_duration_secs", self.cb_window_duration_secs),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return bad(key, "a number > 0", &value);
            }
        }
        let multiplier = self.retry_backoff_multiplier;
        if !(multiplier.is_finite() && multiplier >= 1.0) {
            return bad("retry_backoff_multiplier", "a number >= 1", &multiplier);
        }
        if !(0.0..=1.0).contains(&self.retry_jitter_factor) {
            return bad(
                "retry_jitter_factor",
                "a number in [0, 1]",
                &self.retry_jitter_factor,
            );
        }
        Ok(())
    }

    /// How many times one request may be sent (1 with retries off).
    pub fn attempts(&self) -> u32 {
        if self.disable_retries {
            1
        } else {
            self.retry_max_retries
        }
    }

    pub fn breaker(&self) -> Breaker {
        Breaker::new(
            self.cb_failure_threshold,
            self.cb_success_threshold,
            self.cb_timeout_duration_secs,
            self.cb_window_duration_secs,
            self.disable_circuit_breaker,
        )
    }

    /// Milliseconds after failed attempt `attempt` (0-based), `sample` the random draw.
    pub fn backoff_ms(&self, attempt: u32, sample: f64) -> u64 {
        backoff_ms(
            attempt,
            self.retry_initial_backoff_ms,
            self.retry_max_backoff_ms,
            self.retry_backoff_multiplier,
            self.retry_jitter_factor,
            sample,
        )
    }
}

/// `min(initial * multiplier^attempt, max)` moved by `jitter * sample` of itself, `sample` in
/// [-1, 1]. Repeated multiplication stopped at the cap and half-away rounding, exactly as
/// the twin computes it.
pub fn backoff_ms(
    attempt: u32,
    initial_ms: u64,
    max_ms: u64,
    multiplier: f64,
    jitter: f64,
    sample: f64,
) -> u64 {
    let cap = max_ms as f64;
    let mut delay = initial_ms as f64;
    for _ in 0..attempt {
        if delay >= cap {
            break;
        }
        delay *= multiplier;
    }
    // `as` truncates like Python's int() (and saturates, where int() would grow).
    let base = if delay >= cap { max_ms } else { delay as u64 };
    let sample = sample.clamp(-1.0, 1.0);
    let moved = base as f64 * jitter * sample;
    let shift = (moved.abs() + 0.5).floor() as u64;
    if moved >= 0.0 {
        base.saturating_add(shift)
    } else {
        base.saturating_sub(shift)
    }
}

/// A uniform draw in [-1, 1] from the OS (a retry is rare: no RNG state to keep).
pub fn jitter_sample() -> f64 {
    let bits = getrandom::u64().unwrap_or(1 << 63);
    (bits >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
}

/// One engine's circuit breaker (`CircuitBreaker` of the twin).
#[derive(Debug, Clone)]
pub struct Breaker {
    failure_threshold: u32,
    success_threshold: u32,
    timeout_secs: f64,
    window_secs: f64,
    disabled: bool,
    state: u8,
    failures: u32,
    successes: u32,
    streak_start: f64,
    opened_at: f64,
    pub opened: u64,
}

impl Breaker {
    pub fn new(
        failure_threshold: u32,
        success_threshold: u32,
        timeout_secs: f64,
        window_secs: f64,
        disabled: bool,
    ) -> Self {
        Self {
            failure_threshold,
            success_threshold,
            timeout_secs,
            window_secs,
            disabled,
            state: CLOSED,
            failures: 0,
            successes: 0,
            streak_start: 0.0,
            opened_at: 0.0,
            opened: 0,
        }
    }

    /// The state at `now`: an open breaker past its timeout half-opens.
    pub fn state(&mut self, now: f64) -> u8 {
        if self.state == OPEN && now - self.opened_at >= self.timeout_secs {
            self.state = HALF_OPEN;
            self.failures = 0;
            self.successes = 0;
        }
        self.state
    }

    /// Open as last recorded, without moving to half-open.
    pub fn is_open(&self) -> bool {
        self.state == OPEN
    }

    pub fn allows(&mut self, now: f64) -> bool {
        self.state(now) != OPEN
    }

    /// Count one outcome; the state after it.
    pub fn record(&mut self, success: bool, now: f64) -> u8 {
        if self.disabled {
            return CLOSED;
        }
        let state = self.state(now);
        if success {
            self.failures = 0;
            self.successes = self.successes.saturating_add(1);
            if state == HALF_OPEN && self.successes >= self.success_threshold {
                self.state = CLOSED;
                self.successes = 0;
            }
            return self.state;
        }
        self.successes = 0;
        if self.failures == 0 || now - self.streak_start > self.window_secs {
            self.failures = 0;
            self.streak_start = now;
        }
        self.failures = self.failures.saturating_add(1);
        if state == HALF_OPEN || (state == CLOSED && self.failures >= self.failure_threshold) {
            self.state = OPEN;
            self.opened_at = now;
            self.failures = 0;
            self.opened += 1;
        }
        self.state
    }
}

/// Consecutive probe results of one engine (`HealthCounter` of the twin).
#[derive(Debug, Clone, Default)]
pub struct HealthCounter {
    failed: u32,
    passed: u32,
}

impl HealthCounter {
    /// The engine's health after one probe, given its health before it.
    pub fn probe(&mut self, passed: bool, healthy: bool, config: &Config) -> bool {
        if passed {
            self.failed = 0;
            self.passed = self.passed.saturating_add(1);
            healthy || self.passed >= config.health_success_threshold
        } else {
            self.passed = 0;
            self.failed = self.failed.saturating_add(1);
            healthy && self.failed < config.health_failure_threshold
        }
    }

    pub fn reset(&mut self) {
        *self = Self::default();
    }
}

/// Test hook (`rust/testing.rs`): the backoff schedule, for the twin test.
#[pyfunction]
#[pyo3(signature = (attempt, initial_ms, max_ms, multiplier, jitter, sample))]
pub(crate) fn front_backoff_ms(
    attempt: u32,
    initial_ms: u64,
    max_ms: u64,
    multiplier: f64,
    jitter: f64,
    sample: f64,
) -> u64 {
    backoff_ms(attempt, initial_ms, max_ms, multiplier, jitter, sample)
}

/// Test hook (`rust/testing.rs`): the breaker, for the twin test.
#[pyclass(name = "FrontCircuitBreaker", module = "sessiongate._core")]
pub(crate) struct PyBreaker {
    inner: Breaker,
}

#[pymethods]
impl PyBreaker {
    #[new]
    #[pyo3(signature = (failure_threshold, success_threshold, timeout_secs, window_secs, disabled = false))]
    fn new(
        failure_threshold: u32,
        success_threshold: u32,
        timeout_secs: f64,
        window_secs: f64,
        disabled: bool,
    ) -> Self {
        Self {
            inner: Breaker::new(
                failure_threshold,
                success_threshold,
                timeout_secs,
                window_secs,
                disabled,
            ),
        }
    }

    fn state(&mut self, now: f64) -> u8 {
        self.inner.state(now)
    }

    fn allows(&mut self, now: f64) -> bool {
        self.inner.allows(now)
    }

    fn record(&mut self, success: bool, now: f64) -> u8 {
        self.inner.record(success, now)
    }

    #[getter]
    fn opened(&self) -> u64 {
        self.inner.opened
    }
}

/// Test hook (`rust/testing.rs`): the probe thresholds, for the twin test.
#[pyclass(name = "FrontHealthCounter", module = "sessiongate._core")]
pub(crate) struct PyHealthCounter {
    inner: HealthCounter,
    config: Config,
}

#[pymethods]
impl PyHealthCounter {
    #[new]
    #[pyo3(signature = (failures = 3, successes = 2))]
    fn new(failures: u32, successes: u32) -> Self {
        let config = Config {
            health_failure_threshold: failures,
            health_success_threshold: successes,
            ..Config::default()
        };
        Self {
            inner: HealthCounter::default(),
            config,
        }
    }

    fn probe(&mut self, passed: bool, healthy: bool) -> bool {
        self.inner.probe(passed, healthy, &self.config)
    }

    fn reset(&mut self) {
        self.inner.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_by_the_multiplier_to_the_cap() {
        let got: Vec<u64> = (0..6)
            .map(|a| backoff_ms(a, 50, 200, 1.5, 0.0, 0.0))
            .collect();
        assert_eq!(got, [50, 75, 112, 168, 200, 200]);
        assert_eq!(backoff_ms(0, 100, 1000, 2.0, 0.2, 1.0), 120);
        assert_eq!(backoff_ms(0, 100, 1000, 2.0, 0.2, -1.0), 80);
        assert_eq!(backoff_ms(u32::MAX, 1, u64::MAX, 2.0, 0.0, 0.0), u64::MAX);
    }

    #[test]
    fn breaker_opens_half_opens_and_closes() {
        let mut b = Breaker::new(3, 2, 10.0, 100.0, false);
        assert_eq!(b.record(false, 0.0), CLOSED);
        assert_eq!(b.record(false, 1.0), CLOSED);
        assert_eq!(b.record(false, 2.0), OPEN);
        assert!(!b.allows(11.9));
        assert_eq!(b.state(12.0), HALF_OPEN);
        assert_eq!(b.record(true, 12.0), HALF_OPEN);
        assert_eq!(b.record(true, 12.5), CLOSED);
        // A streak spread wider than the window starts over.
        b.record(false, 20.0);
        b.record(false, 21.0);
        assert_eq!(b.record(false, 200.0), CLOSED);
    }
}
