//! Siblings: requests with one prompt on one engine at once, prefilled there once. The
//! compiled twin of `python/sessiongate/engines/siblings.py`, which says why (SGLang's `fcfs`
//! schedule does no in-batch prefix matching, so a GRPO group's samples admitted in one step
//! each prefill the whole prompt) and what counts as one prompt.
//!
//! The first request with a prompt on an engine goes at once; a second one while it is in
//! flight makes the pool send one warm-up (the prompt, prefill only: `max_new_tokens: 0`),
//! and every sibling waits for it (at most `WARMUP_WAIT`). Once warmed, later siblings go at
//! once; the entry goes when the prompt's last request on the engine ends. While prompts have
//! been arriving in groups (`grouped` >= `LEAD_HOLD_FROM`), a lead on a busy engine sends the
//! warm-up itself and waits for it too, so it is not admitted in one step with its warm-up.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Map, Value};
use tokio::sync::watch;

/// Shorter prompts prefill faster than a sibling would wait for the warm-up's round trip.
pub const SIBLING_MIN_UNITS: usize = 64;
/// A sibling's wait for its warm-up, at most.
pub const WARMUP_WAIT: Duration = Duration::from_secs(30);
pub const GENERATE_PATH: &str = "/generate";
/// Each prompt's weight in `grouped`, and the estimate from which a lead on a busy engine is
/// held too (`siblings.py` says why).
const GROUPED_WEIGHT: f64 = 0.125;
const LEAD_HOLD_FROM: f64 = 0.5;

/// One prompt: its token ids or text, and the adapter and extra key it is cached under (their
/// JSON values as sent: the warm-up carries them back).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PromptKey {
    units: Units,
    lora_path: Option<String>,
    extra_key: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Units {
    Ids(Vec<u64>),
    Text(String),
}

/// The prompt a request shares with its siblings, None when it has none that counts
/// (`siblings.py::prompt_key`).
pub fn prompt_key(method: &str, path: &str, body: &[u8]) -> Option<PromptKey> {
    if method != "POST" || path != GENERATE_PATH {
        return None;
    }
    let doc: Map<String, Value> = serde_json::from_slice(body).ok()?;
    let units = match doc.get("input_ids") {
        Some(Value::Array(ids)) if ids.len() >= SIBLING_MIN_UNITS => {
            // Non-negative integers below 2**64, as the twin checks; anything else: no key.
            Units::Ids(
                ids.iter()
                    .map(Value::as_u64)
                    .collect::<Option<Vec<u64>>>()?,
            )
        }
        None | Some(Value::Null) => match doc.get("text") {
            Some(Value::String(text)) if text.chars().count() >= SIBLING_MIN_UNITS => {
                Units::Text(text.clone())
            }
            _ => return None,
        },
        Some(_) => return None,
    };
    let as_text = |name: &str| match doc.get(name) {
        None | Some(Value::Null) => None,
        Some(value) => Some(value.to_string()),
    };
    Some(PromptKey {
        units,
        lora_path: as_text("lora_path"),
        extra_key: as_text("extra_key"),
    })
}

/// The warm-up for a prompt: the same prompt, adapter and extra_key, prefill only.
pub fn warmup_body(key: &PromptKey) -> Vec<u8> {
    let mut doc = Map::new();
    match &key.units {
        Units::Ids(ids) => doc.insert("input_ids".into(), json!(ids)),
        Units::Text(text) => doc.insert("text".into(), json!(text)),
    };
    doc.insert("sampling_params".into(), json!({"max_new_tokens": 0}));
    for (name, value) in [("lora_path", &key.lora_path), ("extra_key", &key.extra_key)] {
        if let Some(text) = value {
            // Written by `Value::to_string` above: it parses back.
            if let Ok(value) = serde_json::from_str::<Value>(text) {
                doc.insert(name.into(), value);
            }
        }
    }
    Value::Object(doc).to_string().into_bytes()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Lead,
    Warming,
    Warm,
}

struct Entry {
    in_flight: u64,
    state: State,
    /// Whether a second request came while this one was in flight.
    had_sibling: bool,
    warmed: watch::Sender<bool>,
}

impl Entry {
    fn new(state: State) -> Self {
        let (warmed, _) = watch::channel(false);
        Self {
            in_flight: 1,
            state,
            had_sibling: false,
            warmed,
        }
    }
}

/// The prompts in flight, and the share of recent ones that had siblings (a moving average,
/// undecided at the start: `siblings.py` says why).
struct Table {
    prompts: HashMap<Slot, Entry>,
    grouped: f64,
}

impl Default for Table {
    fn default() -> Self {
        Self {
            prompts: HashMap::new(),
            grouped: LEAD_HOLD_FROM,
        }
    }
}

impl Table {
    fn observe(&mut self, grouped: f64) {
        self.grouped += (grouped - self.grouped) * GROUPED_WEIGHT;
    }
}

/// What a request entering with a prompt does.
pub enum Role {
    /// Send now.
    Go,
    /// Send the warm-up (then `warmed`), and wait like a sibling.
    WarmUp(watch::Receiver<bool>),
    /// Wait for the warm-up under way.
    Wait(watch::Receiver<bool>),
}

type Slot = (usize, Arc<PromptKey>);

/// One pool's prompts in flight per engine (by index: a new engine set is a new pool).
#[derive(Default)]
pub struct Siblings {
    table: Mutex<Table>,
    pub held: AtomicU64,
    pub leads_held: AtomicU64,
    pub warmups: AtomicU64,
    pub failed: AtomicU64,
}

impl Siblings {
    /// `busy`: the engine has other requests of this pool in flight.
    pub fn enter(&self, index: usize, key: &Arc<PromptKey>, busy: bool) -> Role {
        let mut table = lock(&self.table);
        let grouped = table.grouped;
        let slot = (index, Arc::clone(key));
        let Some(entry) = table.prompts.get_mut(&slot) else {
            if busy && grouped >= LEAD_HOLD_FROM {
                let entry = Entry::new(State::Warming);
                let warmed = entry.warmed.subscribe();
                table.prompts.insert(slot, entry);
                self.leads_held.fetch_add(1, Relaxed);
                self.warmups.fetch_add(1, Relaxed);
                return Role::WarmUp(warmed);
            }
            table.prompts.insert(slot, Entry::new(State::Lead));
            return Role::Go;
        };
        entry.in_flight += 1;
        let first_sibling = !entry.had_sibling;
        entry.had_sibling = true;
        let role = match entry.state {
            State::Lead => {
                entry.state = State::Warming;
                self.warmups.fetch_add(1, Relaxed);
                self.held.fetch_add(1, Relaxed);
                Role::WarmUp(entry.warmed.subscribe())
            }
            State::Warming => {
                self.held.fetch_add(1, Relaxed);
                Role::Wait(entry.warmed.subscribe())
            }
            State::Warm => Role::Go,
        };
        if first_sibling {
            table.observe(1.0);
        }
        role
    }

    /// The warm-up answered (`took`: with a 200) or failed: release the waiting.
    pub fn warmed(&self, index: usize, key: &Arc<PromptKey>, took: bool) {
        if !took {
            self.failed.fetch_add(1, Relaxed);
        }
        if let Some(entry) = lock(&self.table).prompts.get_mut(&(index, Arc::clone(key))) {
            entry.state = State::Warm;
            entry.warmed.send_replace(true);
        }
    }

    pub fn leave(&self, index: usize, key: &Arc<PromptKey>) {
        let mut table = lock(&self.table);
        let slot = (index, Arc::clone(key));
        if let Some(entry) = table.prompts.get_mut(&slot) {
            entry.in_flight = entry.in_flight.saturating_sub(1);
            if entry.in_flight == 0 {
                // Its sender goes with it: a request still waiting is released.
                let alone = !entry.had_sibling;
                table.prompts.remove(&slot);
                if alone {
                    table.observe(0.0);
                }
            }
        }
    }
}

/// Test hook (rust/testing.rs): the warm-up a request's prompt would get, None when the
/// request has no prompt that counts (`siblings.py::warmup_body` over `prompt_key`).
#[pyo3::pyfunction]
pub fn front_sibling_warmup(
    py: pyo3::Python<'_>,
    method: &str,
    path: &str,
    body: &[u8],
) -> Option<pyo3::Py<pyo3::types::PyBytes>> {
    let key = prompt_key(method, path, body)?;
    Some(pyo3::types::PyBytes::new(py, &warmup_body(&key)).unbind())
}

/// What `front_siblings_roles` returns: roles, `grouped`, counters.
type RolesRun = (Vec<&'static str>, f64, (u64, u64, u64, u64));

/// Test hook (rust/testing.rs): `ops` run on a fresh table, each `(op, engine, prompt,
/// flag)`: "enter" (flag: busy) gives the request's role ("go", "warm_up", "wait"), "warmed"
/// (flag: took) and "leave" give "". Returns the roles, `grouped` and the counters (siblings
/// held, leads held, warm-ups, failed): the twin of `siblings.py`'s `admit` / `warmed` /
/// `leave`, prompt `p` being `SIBLING_MIN_UNITS` ids of value `p`.
#[pyo3::pyfunction]
pub fn front_siblings_roles(ops: Vec<(String, usize, u64, bool)>) -> pyo3::PyResult<RolesRun> {
    let table = Siblings::default();
    let mut roles = Vec::with_capacity(ops.len());
    for (op, engine, prompt, flag) in ops {
        let key = Arc::new(PromptKey {
            units: Units::Ids(vec![prompt; SIBLING_MIN_UNITS]),
            lora_path: None,
            extra_key: None,
        });
        roles.push(match op.as_str() {
            "enter" => match table.enter(engine, &key, flag) {
                Role::Go => "go",
                Role::WarmUp(_) => "warm_up",
                Role::Wait(_) => "wait",
            },
            "warmed" => {
                table.warmed(engine, &key, flag);
                ""
            }
            "leave" => {
                table.leave(engine, &key);
                ""
            }
            other => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "unknown op {other:?}: expected enter, warmed or leave"
                )))
            }
        });
    }
    let grouped = lock(&table.table).grouped;
    let counts = (
        table.held.load(Relaxed),
        table.leads_held.load(Relaxed),
        table.warmups.load(Relaxed),
        table.failed.load(Relaxed),
    );
    Ok((roles, grouped, counts))
}

/// Wait for a warm-up: until it answers, its prompt's entry goes, or `WARMUP_WAIT`.
pub async fn wait_warmed(mut warmed: watch::Receiver<bool>) {
    let _ = tokio::time::timeout(WARMUP_WAIT, warmed.wait_for(|done| *done)).await;
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids_body(n: usize) -> Vec<u8> {
        let ids: Vec<usize> = (0..n).collect();
        json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 4}})
            .to_string()
            .into_bytes()
    }

    #[test]
    fn only_long_generate_prompts_count() {
        assert!(prompt_key("POST", "/generate", &ids_body(64)).is_some());
        assert!(prompt_key("POST", "/generate", &ids_body(63)).is_none());
        assert!(prompt_key("GET", "/generate", &ids_body(64)).is_none());
        assert!(prompt_key("POST", "/v1/completions", &ids_body(64)).is_none());
        assert!(prompt_key("POST", "/generate", b"not json").is_none());
        let negative = json!({"input_ids": vec![-1; 64]}).to_string();
        assert!(prompt_key("POST", "/generate", negative.as_bytes()).is_none());
        let text = json!({"text": "x".repeat(64)}).to_string();
        assert!(prompt_key("POST", "/generate", text.as_bytes()).is_some());
        let both = json!({"input_ids": [1, 2], "text": "x".repeat(64)}).to_string();
        assert!(prompt_key("POST", "/generate", both.as_bytes()).is_none());
    }

    #[test]
    fn the_adapter_and_extra_key_part_prompts() {
        let body = |lora: Value| {
            json!({"input_ids": vec![7; 80], "lora_path": lora, "extra_key": "k"}).to_string()
        };
        let a = prompt_key("POST", "/generate", body(json!("math")).as_bytes());
        let b = prompt_key("POST", "/generate", body(json!("code")).as_bytes());
        assert!(a.is_some() && a != b);
        let warm: Value =
            serde_json::from_slice(&warmup_body(&a.unwrap_or_else(|| panic!("a key"))))
                .unwrap_or_default();
        assert_eq!(warm["lora_path"], "math");
        assert_eq!(warm["extra_key"], "k");
        assert_eq!(warm["sampling_params"]["max_new_tokens"], 0);
        assert_eq!(warm["input_ids"].as_array().map(Vec::len), Some(80));
    }

    #[test]
    fn a_lead_then_one_warm_up_then_waiters_then_go() {
        let siblings = Siblings::default();
        let key = Arc::new(
            prompt_key("POST", "/generate", &ids_body(64)).unwrap_or_else(|| panic!("a key")),
        );
        assert!(matches!(siblings.enter(0, &key, false), Role::Go));
        assert!(
            matches!(siblings.enter(1, &key, false), Role::Go),
            "another engine: its own lead"
        );
        assert!(matches!(siblings.enter(0, &key, false), Role::WarmUp(_)));
        assert!(matches!(siblings.enter(0, &key, false), Role::Wait(_)));
        siblings.warmed(0, &key, true);
        assert!(matches!(siblings.enter(0, &key, false), Role::Go));
        for _ in 0..4 {
            siblings.leave(0, &key);
        }
        assert!(
            matches!(siblings.enter(0, &key, false), Role::Go),
            "a new lead"
        );
        assert_eq!(siblings.warmups.load(Relaxed), 1);
        assert_eq!(siblings.held.load(Relaxed), 2);
    }

    #[test]
    fn leads_on_busy_engines_are_held_once_prompts_come_in_groups() {
        let siblings = Siblings::default();
        let key = |p: usize| {
            Arc::new(
                prompt_key("POST", "/generate", &ids_body(64 + p))
                    .unwrap_or_else(|| panic!("a key")),
            )
        };
        // Undecided: the first lead on a busy engine is held; prompts that come alone are
        // not, from the first that ends alone.
        assert!(matches!(siblings.enter(0, &key(0), true), Role::WarmUp(_)));
        siblings.leave(0, &key(0));
        for p in 1..4 {
            assert!(matches!(siblings.enter(0, &key(p), true), Role::Go));
            siblings.leave(0, &key(p));
        }
        // Groups: each first sibling raises the estimate, until a lead on a busy engine
        // sends the warm-up itself (and one on an idle engine still goes).
        let mut p = 10;
        while lock(&siblings.table).grouped < LEAD_HOLD_FROM {
            assert!(matches!(siblings.enter(0, &key(p), true), Role::Go));
            assert!(matches!(siblings.enter(0, &key(p), true), Role::WarmUp(_)));
            p += 1;
        }
        assert!(matches!(siblings.enter(1, &key(p), false), Role::Go));
        assert!(matches!(siblings.enter(0, &key(p), true), Role::WarmUp(_)));
        assert!(matches!(siblings.enter(0, &key(p), true), Role::Wait(_)));
        assert_eq!(siblings.leads_held.load(Relaxed), 2);
    }
}
