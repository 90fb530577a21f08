//! Engine routing: which engine a stateless request goes to. One file per policy, this file
//! the trait, what a policy sees, the factory and the Python class (`_core.EnginePolicy`).
//! The specification is `python/sessiongate/engines/policy/`; the twin test
//! (tests/engines/test_engine_policy_twin.py) holds both to the same picks.

use std::cell::OnceCell;

use hyper::HeaderMap;
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use serde::Deserialize;

use crate::options::from_py_dict;

mod cache_aware;
mod consistent_hashing;
mod key;
mod least_in_flight;
mod least_load;
mod manual;
mod power_of_two;
mod prefix_hash;
mod random;
mod round_robin;
mod sticky;
mod tree;

pub use key::{key_material, Material};

pub const ROUTING_KEY_HEADER: &str = "x-smg-routing-key";
pub const TARGET_WORKER_HEADER: &str = "x-smg-target-worker";
/// Where consistent_hashing finds a key when the request names none (the Gateway's).
pub const IMPLICIT_KEY_HEADERS: [&str; 3] = ["authorization", "x-forwarded-for", "cookie"];
pub const POLICIES: [&str; 10] = [
    "round_robin",
    "random",
    "power_of_two",
    "least_in_flight",
    "cache_aware",
    "cache_aware_gateway",
    "manual",
    "consistent_hashing",
    "least_load",
    "prefix_hash",
];
/// What power_of_two compares (`--power-of-two-load-metric`).
pub const LOAD_METRICS: [&str; 3] = ["expected_wait", "requests", "least_requests"];

/// Header lookup as a policy needs it.
pub trait Headers {
    /// The first header `name` (lowercase), None when absent or empty.
    fn first(&self, name: &str) -> Option<&[u8]>;
}

impl Headers for HeaderMap {
    fn first(&self, name: &str) -> Option<&[u8]> {
        self.get(name)
            .map(|v| v.as_bytes())
            .filter(|v| !v.is_empty())
    }
}

impl Headers for Vec<(String, String)> {
    fn first(&self, name: &str) -> Option<&[u8]> {
        self.iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_bytes())
            .filter(|v| !v.is_empty())
    }
}

/// One request as a policy sees it; the body is read only by a policy that asks.
pub struct Request<'a> {
    pub headers: &'a dyn Headers,
    pub body: &'a [u8],
    material: OnceCell<Material>,
}

impl<'a> Request<'a> {
    pub fn new(headers: &'a dyn Headers, body: &'a [u8]) -> Self {
        Self {
            headers,
            body,
            material: OnceCell::new(),
        }
    }

    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.first(name)
    }

    /// A request whose key material was read already (kept from an earlier view of it).
    pub fn with_material(headers: &'a dyn Headers, body: &'a [u8], material: Material) -> Self {
        Self {
            headers,
            body,
            material: OnceCell::from(material),
        }
    }

    /// The key material, if it was read.
    pub fn into_material(self) -> Option<Material> {
        self.material.into_inner()
    }

    /// The key material; the text is read too when `text_with_ids` (else only without ids).
    pub fn material(&self, text_with_ids: bool) -> &Material {
        self.material
            .get_or_init(|| key_material(self.body, text_with_ids))
    }
}

/// What an engine's `GET /v1/loads` says, summed over its DP ranks (averaged for the KV
/// token usage): `LoadReport` of `policies/base.py`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadReport {
    pub running_reqs: u64,
    pub waiting_reqs: u64,
    pub waiting_tokens: u64,
    pub token_usage: f64,
    pub throughput: f64,
}

impl LoadReport {
    /// A report from its five figures (the Python tuple's order), or what is wrong with it
    /// (the twin's messages).
    pub fn new(
        running_reqs: i64,
        waiting_reqs: i64,
        waiting_tokens: i64,
        token_usage: f64,
        throughput: f64,
    ) -> Result<Self, String> {
        let count = |name: &str, v: i64| {
            u64::try_from(v)
                .map_err(|_| format!("{name} must be an integer in [0, 2**63), got {v}"))
        };
        let number = |name: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(v)
            } else {
                Err(format!("{name} must be a finite number >= 0, got {v}"))
            }
        };
        Ok(Self {
            running_reqs: count("running_reqs", running_reqs)?,
            waiting_reqs: count("waiting_reqs", waiting_reqs)?,
            waiting_tokens: count("waiting_tokens", waiting_tokens)?,
            token_usage: number("token_usage", token_usage)?,
            throughput: number("throughput", throughput)?,
        })
    }
}

/// The engines as the policies see them.
pub struct EngineStates {
    pub urls: Vec<String>,
    pub healthy: Vec<bool>,
    pub in_flight: Vec<u64>,
    /// What the engine's /get_load last said, None when unknown.
    pub load: Vec<Option<u64>>,
    /// Work in flight as cache_aware estimates it (`policies/base.py`, `EngineStates.work`).
    pub work: Vec<u64>,
    /// What the engine's `GET /v1/loads` last said (None: unknown or aged out), and the
    /// tokens and requests the load-aware policies sent it since (see `policies/base.py`).
    pub loads: Vec<Option<LoadReport>>,
    pub since_tokens: Vec<u64>,
    pub since_reqs: Vec<u64>,
    /// Overload protection's thresholds (queued requests, KV token usage), None when off.
    pub overload: Option<(u64, f64)>,
}

impl EngineStates {
    fn new(urls: Vec<String>) -> Self {
        let n = urls.len();
        Self {
            urls,
            healthy: vec![true; n],
            in_flight: vec![0; n],
            load: vec![None; n],
            work: vec![0; n],
            loads: vec![None; n],
            since_tokens: vec![0; n],
            since_reqs: vec![0; n],
            overload: None,
        }
    }

    pub fn len(&self) -> usize {
        self.urls.len()
    }

    pub fn is_empty(&self) -> bool {
        self.urls.is_empty()
    }

    /// The healthy engines, or every engine when none is; with overload protection, those
    /// of them not overloaded, or when all are, the ones with the fewest queued requests.
    pub fn candidates(&self) -> Vec<usize> {
        let mut live: Vec<usize> = (0..self.len()).filter(|&i| self.healthy[i]).collect();
        if live.is_empty() {
            live = (0..self.len()).collect();
        }
        if self.overload.is_none() {
            return live;
        }
        let under: Vec<usize> = live
            .iter()
            .copied()
            .filter(|&i| !self.overloaded(i))
            .collect();
        if !under.is_empty() {
            return under;
        }
        least(&live, |i| self.loads[i].map_or(0, |r| r.waiting_reqs))
    }

    /// Whether the engine's last `/v1/loads` report is at or over a threshold.
    pub fn overloaded(&self, index: usize) -> bool {
        match (self.loads[index], self.overload) {
            (Some(report), Some((waiting, usage))) => {
                report.waiting_reqs >= waiting || report.token_usage >= usage
            }
            _ => false,
        }
    }

    /// The engine's reported load when known, else its requests in flight.
    pub fn reported_load(&self, index: usize) -> u64 {
        self.load[index].unwrap_or(self.in_flight[index])
    }
}

/// The candidates with the smallest `key(i)`, in candidate order (never empty for a
/// non-empty `candidates`).
pub fn least<K: Ord + Copy>(candidates: &[usize], key: impl Fn(usize) -> K) -> Vec<usize> {
    let Some(best) = candidates.iter().map(|&i| key(i)).min() else {
        return Vec::new();
    };
    candidates
        .iter()
        .copied()
        .filter(|&i| key(i) == best)
        .collect()
}

/// splitmix64, the same generator as the Python twin's, so seeded picks match.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in [0, n) (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// One routing policy.
pub trait Policy: Send + Sync {
    /// An index of `engines` (one of its candidates).
    fn pick(&mut self, request: &Request<'_>, engines: &mut EngineStates) -> usize;
    /// `request` went to engine `index` without a pick (a pinned session family's turn):
    /// learn it as a pick of `index` would (only cache_aware keeps anything of it).
    fn record(&mut self, _index: usize, _request: &Request<'_>, _engines: &mut EngineStates) {}
    /// Engine `index` answered `request` (a 200): its prompt is in the engine's cache (only
    /// cache_aware keeps anything of it).
    fn prefilled(&mut self, _index: usize, _request: &Request<'_>) {}
    /// Units of `request`'s prompt the policy believes engine `index` holds, None when it
    /// learns nothing from replies' `cached_tokens` (only cache_aware on token ids does).
    fn held(&self, _index: usize, _request: &Request<'_>) -> Option<u64> {
        None
    }
    /// Engine `index` answered `request` with `cached` of its prompt served from its cache,
    /// where `held` was `held` at the pick (only cache_aware keeps anything of it): the
    /// units the engine is learned to have lost, 0 when none.
    fn cached(&mut self, _index: usize, _request: &Request<'_>, _held: u64, _cached: u64) -> u64 {
        0
    }
    /// Trim state; `now` is seconds on a monotonic clock.
    fn evict(&mut self, _now: f64) {}
}

/// The tunables (`EngineRoutingConfig.options()` of the Python side, read by
/// `crate::options`; the defaults are its defaults).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Options {
    pub cache_threshold: f64,
    pub balance_abs_threshold: u64,
    pub balance_rel_threshold: f64,
    pub eviction_interval_secs: u64,
    pub max_tree_size: u64,
    pub assignment_mode: String,
    pub max_idle_secs: u64,
    pub tie_break: String,
    pub seed: Option<u64>,
    pub least_load_kv_pressure_weight: f64,
    pub least_load_default_throughput: f64,
    pub least_load_mean_prefill_tokens: u64,
    pub least_load_max_waiting_requests: u64,
    pub power_of_two_load_metric: String,
    /// Read by the load poll, not by a policy.
    pub load_monitor_interval: u64,
    pub prefix_token_count: u64,
    pub prefix_hash_load_factor: f64,
    pub prefix_hash_balance_abs_threshold: u64,
    pub sticky_sessions: bool,
    pub routing_key_headers: Vec<String>,
    pub worker_overload_protection: bool,
    pub worker_overload_waiting_requests: u64,
    pub worker_overload_token_usage: f64,
    /// Read by the compiled front's pool (`front/siblings.rs`), not by a policy.
    pub hold_siblings: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            eviction_interval_secs: 60,
            max_tree_size: 1 << 26,
            assignment_mode: "random".into(),
            max_idle_secs: 14_400,
            tie_break: "index".into(),
            seed: None,
            least_load_kv_pressure_weight: 0.15,
            least_load_default_throughput: 2000.0,
            least_load_mean_prefill_tokens: 1024,
            least_load_max_waiting_requests: 0,
            power_of_two_load_metric: "expected_wait".into(),
            load_monitor_interval: 10,
            prefix_token_count: 256,
            prefix_hash_load_factor: 1.25,
            prefix_hash_balance_abs_threshold: 10,
            sticky_sessions: false,
            routing_key_headers: vec![ROUTING_KEY_HEADER.to_string()],
            worker_overload_protection: false,
            worker_overload_waiting_requests: 8,
            worker_overload_token_usage: 0.8,
            hold_siblings: true,
        }
    }
}

impl Options {
    /// From the Python dict of `EngineRoutingConfig.options()` (None: the defaults); a
    /// ValueError names the key.
    pub fn from_dict(dict: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let options: Self = from_py_dict("engine routing options", dict)?;
        options.check().map_err(PyValueError::new_err)?;
        Ok(options)
    }

    /// What is wrong with these values (the Python side's messages), or Ok.
    pub fn check(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.cache_threshold) {
            return Err(format!(
                "cache_threshold must be in [0, 1], got {}",
                self.cache_threshold
            ));
        }
        if !(self.balance_rel_threshold.is_finite() && self.balance_rel_threshold >= 0.0) {
            return Err(format!(
                "balance_rel_threshold must be a number >= 0, got {}",
                self.balance_rel_threshold
            ));
        }
        if !["random", "min_load", "min_group"].contains(&self.assignment_mode.as_str()) {
            return Err(format!(
                "unknown assignment_mode {:?}; expected one of random, min_load, min_group",
                self.assignment_mode
            ));
        }
        if self.routing_key_headers.is_empty() {
            return Err("routing_key_headers needs at least one header name".into());
        }
        for name in &self.routing_key_headers {
            let token = |c: u8| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c);
            if name.is_empty() || !name.bytes().all(token) {
                // Quoted as JSON, as the twin quotes it.
                let quoted = serde_json::to_string(name).unwrap_or_default();
                return Err(format!(
                    "routing_key_headers: {quoted} is not an HTTP header name"
                ));
            }
        }
        if !["index", "round_robin"].contains(&self.tie_break.as_str()) {
            return Err(format!(
                "unknown tie_break {:?}; expected one of index, round_robin",
                self.tie_break
            ));
        }
        let weight = self.least_load_kv_pressure_weight;
        if !(weight.is_finite() && weight >= 0.0) {
            return Err(format!(
                "least_load_kv_pressure_weight must be a number >= 0, got {weight}"
            ));
        }
        let rate = self.least_load_default_throughput;
        if !(rate.is_finite() && rate > 0.0) {
            return Err(format!(
                "least_load_default_throughput must be a number > 0, got {rate}"
            ));
        }
        for (name, value) in [
            (
                "least_load_mean_prefill_tokens",
                self.least_load_mean_prefill_tokens,
            ),
            ("load_monitor_interval", self.load_monitor_interval),
            ("prefix_token_count", self.prefix_token_count),
        ] {
            if value < 1 {
                return Err(format!("{name} must be >= 1, got {value}"));
            }
        }
        if self.worker_overload_waiting_requests < 1 {
            return Err(format!(
                "worker_overload_waiting_requests must be >= 1, got {}",
                self.worker_overload_waiting_requests
            ));
        }
        let usage = self.worker_overload_token_usage;
        if !(usage.is_finite() && usage > 0.0 && usage <= 1.0) {
            return Err(format!(
                "worker_overload_token_usage must be in (0, 1], got {usage}"
            ));
        }
        if !LOAD_METRICS.contains(&self.power_of_two_load_metric.as_str()) {
            return Err(format!(
                "unknown power_of_two_load_metric {:?}; expected one of {}",
                self.power_of_two_load_metric,
                LOAD_METRICS.join(", ")
            ));
        }
        let factor = self.prefix_hash_load_factor;
        if !(factor.is_finite() && factor >= 1.0) {
            return Err(format!(
                "prefix_hash_load_factor must be a number >= 1, got {factor}"
            ));
        }
        Ok(())
    }
}

fn os_seed() -> u64 {
    let mut bytes = [0u8; 8];
    // Without OS randomness a fixed seed still spreads load; only unpredictability is lost.
    let _ = getrandom::fill(&mut bytes);
    u64::from_be_bytes(bytes)
}

/// The policy `name` over `engines` engines.
pub fn make_policy(
    name: &str,
    options: &Options,
    engines: usize,
) -> Result<Box<dyn Policy>, String> {
    let seed = options.seed.unwrap_or_else(os_seed);
    Ok(match name {
        "round_robin" => Box::new(round_robin::RoundRobin::default()),
        "random" => Box::new(random::RandomPick::new(seed)),
        "power_of_two" => Box::new(power_of_two::PowerOfTwo::new(options, seed)),
        "least_in_flight" => Box::new(least_in_flight::LeastInFlight::new(&options.tie_break)),
        "cache_aware" => Box::new(cache_aware::CacheAware::new(options, engines, false)),
        "cache_aware_gateway" => Box::new(cache_aware::CacheAware::new(options, engines, true)),
        "manual" => Box::new(manual::Manual::new(options, engines, seed)),
        "consistent_hashing" => Box::new(consistent_hashing::ConsistentHashing::new(seed)),
        "least_load" => Box::new(least_load::LeastLoad::new(options, seed)),
        "prefix_hash" => Box::new(prefix_hash::PrefixHash::new(options)),
        _ => {
            return Err(format!(
                "unknown policy {name:?}; expected one of {}",
                POLICIES.join(", ")
            ))
        }
    })
}

/// A policy and the engine states it decides on, and the sticky keys over it when
/// `sticky_sessions` applies to it.
pub struct PolicyState {
    name: String,
    policy: Box<dyn Policy>,
    sticky: Option<sticky::StickyKeys>,
    pub engines: EngineStates,
    options: Options,
}

impl PolicyState {
    /// An empty `urls` makes the policy state of a pool that relays nothing yet (the compiled
    /// front before engines register): never `pick` on it.
    pub fn new(name: &str, urls: Vec<String>, options: Options) -> Result<Self, String> {
        options.check()?;
        let policy = make_policy(name, &options, urls.len())?;
        let sticky =
            (options.sticky_sessions && !sticky::OWN_KEY_POLICIES.contains(&name)).then(|| {
                sticky::StickyKeys::new(
                    &options.routing_key_headers,
                    options.max_idle_secs,
                    policy_reads_body(name) == Some(true),
                )
            });
        let mut engines = EngineStates::new(urls);
        engines.overload = options.worker_overload_protection.then_some((
            options.worker_overload_waiting_requests,
            options.worker_overload_token_usage,
        ));
        Ok(Self {
            name: name.to_string(),
            policy,
            sticky,
            engines,
            options,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The same policy and tunables over another engine set, its state afresh.
    pub fn with_urls(&self, urls: Vec<String>) -> Result<Self, String> {
        Self::new(&self.name, urls, self.options.clone())
    }

    /// Seconds between `evict` calls, None when the policy keeps nothing to trim.
    pub fn eviction_interval(&self) -> Option<u64> {
        let trims = matches!(
            self.name.as_str(),
            "cache_aware" | "cache_aware_gateway" | "manual"
        ) || self.sticky.is_some();
        (trims && self.options.eviction_interval_secs > 0)
            .then_some(self.options.eviction_interval_secs)
    }

    pub fn pick(&mut self, headers: &dyn Headers, body: &[u8]) -> usize {
        self.pick_request(&Request::new(headers, body))
    }

    /// `pick` for a request whose key material the caller may have read already (outside
    /// the lock a shared policy state sits behind: see `reads_body`).
    pub fn pick_request(&mut self, request: &Request<'_>) -> usize {
        self.pick_keyed(request).0
    }

    /// The engine and the request's sticky key (None without sticky keys or without a key):
    /// pass the key to `started` and `finished`.
    pub fn pick_keyed(&mut self, request: &Request<'_>) -> (usize, Option<String>) {
        let (index, key) = match self.sticky.as_mut() {
            Some(sticky) => sticky.pick(request, &mut self.engines, self.policy.as_mut()),
            None => (self.policy.pick(request, &mut self.engines), None),
        };
        // A policy bug must not index out of bounds in the caller.
        (index.min(self.engines.len().saturating_sub(1)), key)
    }

    /// Whether the pool holds siblings (`front/siblings.rs`).
    pub fn holds_siblings(&self) -> bool {
        self.options.hold_siblings
    }

    /// Whether the policy reads the engines' `GET /v1/loads` (`EngineRoutingConfig.reads_loads`):
    /// the seconds between polls when it does.
    pub fn load_interval(&self) -> Option<u64> {
        let reads = match self.name.as_str() {
            "least_load" => true,
            "power_of_two" => self.options.power_of_two_load_metric != "least_requests",
            _ => false,
        } || self.options.worker_overload_protection;
        reads.then_some(self.options.load_monitor_interval)
    }

    /// Whether the policy reads the body's key material, and if so with the text when the
    /// body has token ids (`Request::material`'s argument). least_load reads the ids' count
    /// for nearly every pick once engines report loads, so outside the lock too;
    /// power_of_two only when one of its two engines has a report (lazily, in the pick: an
    /// engine set that never reports pays nothing).
    /// Sticky keys read the rid from the body whatever the policy.
    pub fn reads_body(&self) -> Option<bool> {
        policy_reads_body(&self.name).or(self.sticky.is_some().then_some(false))
    }

    /// See `Policy::record`; an index out of range is ignored.
    pub fn record(&mut self, index: usize, headers: &dyn Headers, body: &[u8]) {
        if index < self.engines.len() {
            self.policy
                .record(index, &Request::new(headers, body), &mut self.engines);
        }
    }

    /// Engine `index` answered this request (a 200): see `Policy::prefilled`.
    pub fn prefilled(&mut self, index: usize, request: &Request<'_>) {
        if index < self.engines.len() {
            self.policy.prefilled(index, request);
        }
    }

    /// See `Policy::held`; None for an index out of range.
    pub fn held(&self, index: usize, request: &Request<'_>) -> Option<u64> {
        (index < self.engines.len())
            .then(|| self.policy.held(index, request))
            .flatten()
    }

    /// See `Policy::cached`; an index out of range is ignored (0).
    pub fn cached(&mut self, index: usize, request: &Request<'_>, held: u64, cached: u64) -> u64 {
        if index < self.engines.len() {
            self.policy.cached(index, request, held, cached)
        } else {
            0
        }
    }

    /// Whether `prefilled` is read: the callers skip it (and the body it needs) otherwise.
    pub fn learns_prefills(&self) -> bool {
        self.name == "cache_aware"
    }

    /// The request's sticky key (what `pick_keyed` answers with the engine).
    pub fn sticky_key(&self, request: &Request<'_>) -> Option<String> {
        self.sticky.as_ref()?.key_of(request)
    }

    /// A request is sent to `index` (`key`: its sticky key from `pick_keyed`).
    pub fn started(&mut self, index: usize, key: Option<&str>) {
        if let Some(n) = self.engines.in_flight.get_mut(index) {
            *n += 1;
            if let (Some(key), Some(sticky)) = (key, self.sticky.as_mut()) {
                sticky.started(key, index);
            }
        }
    }

    pub fn finished(&mut self, index: usize, key: Option<&str>) {
        if let (Some(key), Some(sticky)) = (key, self.sticky.as_mut()) {
            sticky.finished(key, index);
        }
        let engines = &mut self.engines;
        if let (Some(n), Some(work)) = (
            engines.in_flight.get_mut(index),
            engines.work.get_mut(index),
        ) {
            // Which request ended is not known: take off the engine's mean work per
            // request, and nothing is left once nothing is in flight.
            *work = if *n > 1 { *work - *work / *n } else { 0 };
            *n = n.saturating_sub(1);
        }
    }

    pub fn set_healthy(&mut self, index: usize, healthy: bool) {
        if let Some(h) = self.engines.healthy.get_mut(index) {
            *h = healthy;
        }
    }

    pub fn set_load(&mut self, index: usize, load: Option<u64>) {
        if let Some(l) = self.engines.load.get_mut(index) {
            *l = load;
        }
    }

    /// See `EnginePolicy.set_loads` of the twin: a report resets the since-report counts.
    pub fn set_loads(&mut self, index: usize, report: Option<LoadReport>) {
        let engines = &mut self.engines;
        if let Some(slot) = engines.loads.get_mut(index) {
            *slot = report;
            if report.is_some() {
                engines.since_tokens[index] = 0;
                engines.since_reqs[index] = 0;
            }
        }
    }

    pub fn evict(&mut self, now: f64) {
        self.policy.evict(now);
        if let Some(sticky) = self.sticky.as_mut() {
            sticky.evict(now);
        }
    }
}

/// Whether policy `name` reads the body's key material, and with the text when the body has
/// token ids: see `PolicyState::reads_body`.
fn policy_reads_body(name: &str) -> Option<bool> {
    match name {
        "cache_aware" | "prefix_hash" | "least_load" => Some(false),
        "cache_aware_gateway" => Some(true),
        _ => None,
    }
}

/// `_core.EnginePolicy`: see `python/sessiongate/_core.pyi`.
#[pyclass(name = "EnginePolicy", module = "sessiongate._core")]
pub struct PyEnginePolicy {
    state: PolicyState,
}

impl PyEnginePolicy {
    /// `index` as an engine index, IndexError (as the twin's) when there is no such engine.
    fn check(&self, index: i64) -> PyResult<usize> {
        let n = self.state.engines.len();
        match usize::try_from(index) {
            Ok(i) if i < n => Ok(i),
            _ => Err(PyIndexError::new_err(format!(
                "engine index {index} out of range (0..{})",
                n - 1
            ))),
        }
    }
}

#[pymethods]
impl PyEnginePolicy {
    #[new]
    #[pyo3(signature = (name, engines, options = None))]
    fn new(
        name: &str,
        engines: Vec<String>,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        if engines.is_empty() {
            return Err(PyValueError::new_err("at least one engine URL is needed"));
        }
        let options = Options::from_dict(options)?;
        let state = PolicyState::new(name, engines, options).map_err(PyValueError::new_err)?;
        Ok(Self { state })
    }

    #[getter]
    fn name(&self) -> &str {
        self.state.name()
    }

    #[getter]
    fn in_flight(&self) -> Vec<u64> {
        self.state.engines.in_flight.clone()
    }

    fn pick(&mut self, headers: Vec<(String, String)>, body: &[u8]) -> usize {
        self.state.pick(&headers, body)
    }

    fn pick_keyed(
        &mut self,
        headers: Vec<(String, String)>,
        body: &[u8],
    ) -> (usize, Option<String>) {
        self.state.pick_keyed(&Request::new(&headers, body))
    }

    fn sticky_key(&self, headers: Vec<(String, String)>, body: &[u8]) -> Option<String> {
        self.state.sticky_key(&Request::new(&headers, body))
    }

    fn record(&mut self, index: i64, headers: Vec<(String, String)>, body: &[u8]) -> PyResult<()> {
        let index = self.check(index)?;
        self.state.record(index, &headers, body);
        Ok(())
    }

    fn prefilled(
        &mut self,
        index: i64,
        headers: Vec<(String, String)>,
        body: &[u8],
    ) -> PyResult<()> {
        let index = self.check(index)?;
        self.state.prefilled(index, &Request::new(&headers, body));
        Ok(())
    }

    fn held(
        &self,
        index: i64,
        headers: Vec<(String, String)>,
        body: &[u8],
    ) -> PyResult<Option<u64>> {
        let index = self.check(index)?;
        Ok(self.state.held(index, &Request::new(&headers, body)))
    }

    fn cached(
        &mut self,
        index: i64,
        headers: Vec<(String, String)>,
        body: &[u8],
        held: i64,
        cached_tokens: i64,
    ) -> PyResult<u64> {
        let index = self.check(index)?;
        let count = |name: &str, n: i64| {
            u64::try_from(n)
                .map_err(|_| PyValueError::new_err(format!("{name} must be >= 0, got {n}")))
        };
        let held = count("held", held)?;
        let cached_tokens = count("cached_tokens", cached_tokens)?;
        Ok(self
            .state
            .cached(index, &Request::new(&headers, body), held, cached_tokens))
    }

    #[pyo3(signature = (index, key = None))]
    fn started(&mut self, index: i64, key: Option<&str>) -> PyResult<()> {
        let index = self.check(index)?;
        self.state.started(index, key);
        Ok(())
    }

    #[pyo3(signature = (index, cached_tokens = None, key = None))]
    fn finished(
        &mut self,
        index: i64,
        cached_tokens: Option<i64>,
        key: Option<&str>,
    ) -> PyResult<()> {
        // Accepted, not read: a reply's cached_tokens reaches the policy through `cached`.
        let _ = cached_tokens;
        let index = self.check(index)?;
        self.state.finished(index, key);
        Ok(())
    }

    fn set_load(&mut self, index: i64, load: Option<i64>) -> PyResult<()> {
        let index = self.check(index)?;
        let load = match load {
            Some(l) => Some(
                u64::try_from(l)
                    .map_err(|_| PyValueError::new_err(format!("load must be >= 0, got {l}")))?,
            ),
            None => None,
        };
        self.state.set_load(index, load);
        Ok(())
    }

    #[pyo3(signature = (index, report))]
    fn set_loads(&mut self, index: i64, report: Option<(i64, i64, i64, f64, f64)>) -> PyResult<()> {
        let index = self.check(index)?;
        let report = match report {
            Some((running, waiting, tokens, usage, rate)) => Some(
                LoadReport::new(running, waiting, tokens, usage, rate)
                    .map_err(PyValueError::new_err)?,
            ),
            None => None,
        };
        self.state.set_loads(index, report);
        Ok(())
    }

    fn set_healthy(&mut self, index: i64, healthy: bool) -> PyResult<()> {
        let index = self.check(index)?;
        self.state.set_healthy(index, healthy);
        Ok(())
    }

    fn evict(&mut self, now: f64) {
        self.state.evict(now);
    }

    fn __repr__(&self) -> String {
        format!(
            "<EnginePolicy {} engines={:?}>",
            self.state.name(),
            self.state.engines.urls
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEnginePolicy>()?;
    Ok(())
}
