//! Siblings: requests with one prompt on one engine at once, prefilled there once. The
//! compiled twin of `python/sessiongate/engines/siblings.py`, which says why (SGLang's `fcfs`
//! schedule does no in-batch prefix matching, so a GRPO group's samples admitted in one step
//! each prefill the whole prompt) and what counts as one prompt.
//!
//! The first request with a prompt on an engine goes at once; a second one while it is in
//! flight makes the pool send one warm-up (the prompt, prefill only: `max_new_tokens: 0`),
//! and every sibling waits for it (at most `WARMUP_WAIT`). Once warmed, later siblings go at
//! once; the entry goes when the prompt's last request on the engine ends. While prompts have
//! been arriving in groups (`grouped` >= `LEAD_HOLD_FROM`), a lead sends the warm-up itself
//! and waits for it too, so it is not admitted in one step with its warm-up; a held lead
//! sharing `SIBLING_MIN_UNITS` more leading units with a prompt being warmed up there than
//! with any warmed one follows that warm-up first, so a shared prefix is prefilled once.

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
/// Each prompt's weight in `grouped`, and the estimate from which a lead is held too
/// (`siblings.py` says why).
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

/// The warm-up for a prompt: the same prompt (ids without the last, which every request
/// recomputes: `siblings.py` says why), adapter and extra_key, prefill only.
pub fn warmup_body(key: &PromptKey) -> Vec<u8> {
    let mut doc = Map::new();
    match &key.units {
        Units::Ids(ids) => doc.insert(
            "input_ids".into(),
            json!(ids.split_last().map_or(&ids[..], |(_, head)| head)),
        ),
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

impl PromptKey {
    /// How many leading ids (or characters) two prompts share in one cache namespace (the
    /// same kind, adapter and extra key), 0 across namespaces (`siblings.py::shared_units`).
    fn shared_units(&self, other: &PromptKey) -> usize {
        if self.lora_path != other.lora_path || self.extra_key != other.extra_key {
            return 0;
        }
        match (&self.units, &other.units) {
            (Units::Ids(a), Units::Ids(b)) => a.iter().zip(b).take_while(|(x, y)| x == y).count(),
            (Units::Text(a), Units::Text(b)) => {
                a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count()
            }
            _ => 0,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Lead,
    Following,
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

    /// The warm-up signal of the prompt being warmed up on engine `index` that a new lead
    /// should follow: the one sharing the most leading units with `key`, when that is
    /// `SIBLING_MIN_UNITS` more than it shares with any prompt warmed there.
    fn anchor(&self, index: usize, key: &PromptKey) -> Option<watch::Receiver<bool>> {
        let mut best: Option<&Entry> = None;
        let (mut warming, mut warm) = (0, 0);
        // Of two warm-ups sharing as much, either is followed (the map's order decides):
        // each leaves the shared prefix cached.
        for ((at, other), entry) in &self.prompts {
            if *at != index || !matches!(entry.state, State::Warming | State::Warm) {
                continue;
            }
            let shared = key.shared_units(other);
            if entry.state == State::Warm {
                warm = warm.max(shared);
            } else if shared > warming {
                best = Some(entry);
                warming = shared;
            }
        }
        let entry = best?;
        (warming >= warm + SIBLING_MIN_UNITS).then(|| entry.warmed.subscribe())
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
    /// Wait for another prompt's warm-up (its anchor's), then `resume`.
    Follow(watch::Receiver<bool>),
}

type Slot = (usize, Arc<PromptKey>);

/// One pool's prompts in flight per engine (by index: a new engine set is a new pool).
#[derive(Default)]
pub struct Siblings {
    table: Mutex<Table>,
    pub held: AtomicU64,
    pub leads_held: AtomicU64,
    pub leads_followed: AtomicU64,
    pub warmups: AtomicU64,
    pub failed: AtomicU64,
}

impl Siblings {
    pub fn enter(&self, index: usize, key: &Arc<PromptKey>) -> Role {
        let mut table = lock(&self.table);
        let grouped = table.grouped;
        let slot = (index, Arc::clone(key));
        let Some(entry) = table.prompts.get_mut(&slot) else {
            if grouped < LEAD_HOLD_FROM {
                table.prompts.insert(slot, Entry::new(State::Lead));
                return Role::Go;
            }
            self.leads_held.fetch_add(1, Relaxed);
            if let Some(warmed) = table.anchor(index, key) {
                table.prompts.insert(slot, Entry::new(State::Following));
                self.leads_followed.fetch_add(1, Relaxed);
                return Role::Follow(warmed);
            }
            let entry = Entry::new(State::Warming);
            let warmed = entry.warmed.subscribe();
            table.prompts.insert(slot, entry);
            self.warmups.fetch_add(1, Relaxed);
            return Role::WarmUp(warmed);
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
            State::Warming | State::Following => {
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

    /// A following lead's anchor is warmed (or gone): its own warm-up when siblings joined it
    /// meanwhile, else go.
    pub fn resume(&self, index: usize, key: &Arc<PromptKey>) -> Role {
        let mut table = lock(&self.table);
        let Some(entry) = table.prompts.get_mut(&(index, Arc::clone(key))) else {
            return Role::Go;
        };
        if entry.state != State::Following {
            return Role::Go;
        }
        if entry.had_sibling {
            entry.state = State::Warming;
            self.warmups.fetch_add(1, Relaxed);
            return Role::WarmUp(entry.warmed.subscribe());
        }
        entry.state = State::Lead;
        Role::Go
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
type RolesRun = (Vec<&'static str>, f64, (u64, u64, u64, u64, u64));

/// Test hook (rust/testing.rs): `ops` run on a fresh table, each `(op, engine, prompt ids,
/// took)`: "enter" and "resume" give the request's role ("go", "warm_up", "wait",
/// "follow"), "warmed" (with `took`) and "leave" give "". Returns the roles, `grouped` and the
/// counters (siblings held, leads held, leads followed, warm-ups, failed): the twin of
/// `siblings.py`'s `admit` / `resume` / `warmed` / `leave`.
#[pyo3::pyfunction]
pub fn front_siblings_roles(ops: Vec<(String, usize, Vec<u64>, bool)>) -> pyo3::PyResult<RolesRun> {
    let table = Siblings::default();
    let mut roles = Vec::with_capacity(ops.len());
    let name = |role: Role| match role {
        Role::Go => "go",
        Role::WarmUp(_) => "warm_up",
        Role::Wait(_) => "wait",
        Role::Follow(_) => "follow",
    };
    for (op, engine, ids, took) in ops {
        let key = Arc::new(PromptKey {
            units: Units::Ids(ids),
            lora_path: None,
            extra_key: None,
        });
        roles.push(match op.as_str() {
            "enter" => name(table.enter(engine, &key)),
            "resume" => name(table.resume(engine, &key)),
            "warmed" => {
                table.warmed(engine, &key, took);
                ""
            }
            "leave" => {
                table.leave(engine, &key);
                ""
            }
            other => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "unknown op {other:?}: expected enter, resume, warmed or leave"
                )))
            }
        });
    }
    let grouped = lock(&table.table).grouped;
    let counts = (
        table.held.load(Relaxed),
        table.leads_held.load(Relaxed),
        table.leads_followed.load(Relaxed),
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
        assert_eq!(warm["input_ids"].as_array().map(Vec::len), Some(79));
    }

    fn key(ids: Vec<u64>) -> Arc<PromptKey> {
        Arc::new(PromptKey {
            units: Units::Ids(ids),
            lora_path: None,
            extra_key: None,
        })
    }

    #[test]
    fn a_lead_then_one_warm_up_then_waiters_then_go() {
        let siblings = Siblings::default();
        lock(&siblings.table).grouped = 0.0;
        let key = key((0..64).collect());
        assert!(matches!(siblings.enter(0, &key), Role::Go));
        assert!(
            matches!(siblings.enter(1, &key), Role::Go),
            "another engine: its own lead"
        );
        assert!(matches!(siblings.enter(0, &key), Role::WarmUp(_)));
        assert!(matches!(siblings.enter(0, &key), Role::Wait(_)));
        siblings.warmed(0, &key, true);
        assert!(matches!(siblings.enter(0, &key), Role::Go));
        for _ in 0..4 {
            siblings.leave(0, &key);
        }
        assert!(matches!(siblings.enter(0, &key), Role::Go), "a new lead");
        assert_eq!(siblings.warmups.load(Relaxed), 1);
        assert_eq!(siblings.held.load(Relaxed), 2);
    }

    #[test]
    fn leads_are_held_once_prompts_come_in_groups() {
        let siblings = Siblings::default();
        let key = |p: u64| key(vec![p; 64]);
        // Undecided: the first lead is held; prompts that come alone are not, from the
        // first that ends alone.
        assert!(matches!(siblings.enter(0, &key(0)), Role::WarmUp(_)));
        siblings.leave(0, &key(0));
        for p in 1..4 {
            assert!(matches!(siblings.enter(0, &key(p)), Role::Go));
            siblings.leave(0, &key(p));
        }
        // Groups: each first sibling raises the estimate, until a lead sends the warm-up
        // itself.
        let mut p = 10;
        while lock(&siblings.table).grouped < LEAD_HOLD_FROM {
            assert!(matches!(siblings.enter(0, &key(p)), Role::Go));
            assert!(matches!(siblings.enter(0, &key(p)), Role::WarmUp(_)));
            p += 1;
        }
        assert!(matches!(siblings.enter(0, &key(p)), Role::WarmUp(_)));
        assert!(matches!(siblings.enter(0, &key(p)), Role::Wait(_)));
        assert_eq!(siblings.leads_held.load(Relaxed), 2);
    }

    #[test]
    fn a_lead_sharing_a_prefix_being_warmed_up_follows_it() {
        let siblings = Siblings::default();
        let prompt = |tail: u64| {
            let mut ids = vec![7; 100];
            ids.extend([tail; 10]);
            key(ids)
        };
        assert!(matches!(siblings.enter(0, &prompt(1)), Role::WarmUp(_)));
        assert!(
            matches!(siblings.enter(1, &prompt(2)), Role::WarmUp(_)),
            "another engine"
        );
        let Role::Follow(anchor) = siblings.enter(0, &prompt(2)) else {
            panic!("a lead sharing 100 ids with a warm-up under way follows it");
        };
        assert!(
            matches!(siblings.enter(0, &prompt(2)), Role::Wait(_)),
            "its sibling waits"
        );
        siblings.warmed(0, &prompt(1), true);
        assert!(anchor.has_changed().unwrap_or(false));
        assert!(
            matches!(siblings.resume(0, &prompt(2)), Role::WarmUp(_)),
            "siblings joined"
        );
        // The prefix is warm on engine 0 now: a third prompt sends its own warm-up.
        assert!(matches!(siblings.enter(0, &prompt(3)), Role::WarmUp(_)));
        // A follower without siblings goes once resumed.
        assert!(matches!(siblings.enter(1, &prompt(4)), Role::Follow(_)));
        assert!(matches!(siblings.resume(1, &prompt(4)), Role::Go));
        assert_eq!(siblings.leads_followed.load(Relaxed), 2);
    }

    #[test]
    fn shared_units_stay_in_one_namespace() {
        let a = PromptKey {
            units: Units::Text("abcdef".into()),
            lora_path: None,
            extra_key: None,
        };
        let mut b = a.clone();
        b.units = Units::Text("abcxyz".into());
        assert_eq!(a.shared_units(&b), 3);
        b.lora_path = Some("\"math\"".into());
        assert_eq!(a.shared_units(&b), 0);
        assert_eq!(key(vec![1, 2, 3]).shared_units(&key(vec![1, 2, 4])), 2);
    }
}
