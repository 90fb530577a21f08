//! Siblings: requests with one prompt on one engine at once, prefilled there once. The
//! compiled twin of `python/sessiongate/engines/siblings.py`, which says why (SGLang's `fcfs`
//! schedule does no in-batch prefix matching, so a GRPO group's samples admitted in one step
//! each prefill the whole prompt) and what counts as one prompt.
//!
//! The first request with a prompt on an engine goes at once; a second one while it is in
//! flight makes the pool send one warm-up (the prompt, prefill only: `max_new_tokens: 0`),
//! and every sibling waits for it (at most `WARMUP_WAIT`). Once warmed, later siblings go at
//! once; the entry goes when the prompt's last request on the engine ends.

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
    warmed: watch::Sender<bool>,
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
    prompts: Mutex<HashMap<Slot, Entry>>,
    pub held: AtomicU64,
    pub warmups: AtomicU64,
    pub failed: AtomicU64,
}

impl Siblings {
    pub fn enter(&self, index: usize, key: &Arc<PromptKey>) -> Role {
        let mut prompts = lock(&self.prompts);
        let Some(entry) = prompts.get_mut(&(index, Arc::clone(key))) else {
            let (warmed, _) = watch::channel(false);
            let entry = Entry {
                in_flight: 1,
                state: State::Lead,
                warmed,
            };
            prompts.insert((index, Arc::clone(key)), entry);
            return Role::Go;
        };
        entry.in_flight += 1;
        match entry.state {
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
        }
    }

    /// The warm-up answered (`took`: with a 200) or failed: release the siblings.
    pub fn warmed(&self, index: usize, key: &Arc<PromptKey>, took: bool) {
        if !took {
            self.failed.fetch_add(1, Relaxed);
        }
        if let Some(entry) = lock(&self.prompts).get_mut(&(index, Arc::clone(key))) {
            entry.state = State::Warm;
            entry.warmed.send_replace(true);
        }
    }

    pub fn leave(&self, index: usize, key: &Arc<PromptKey>) {
        let mut prompts = lock(&self.prompts);
        let slot = (index, Arc::clone(key));
        if let Some(entry) = prompts.get_mut(&slot) {
            entry.in_flight = entry.in_flight.saturating_sub(1);
            if entry.in_flight == 0 {
                // Its sender goes with it: a sibling still waiting is released.
                prompts.remove(&slot);
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
}
