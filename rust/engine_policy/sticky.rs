//! Sticky keys (`--sticky-sessions`) over a policy, as `policies/sticky.py`: a key from the
//! body's rid (lineage suffixes stripped) or the routing-key headers, pinned to the engine
//! its first request went to; a key with two requests in flight there spills to the
//! policy's pick; idle pins are forgotten by `evict`.

use std::collections::HashMap;

use super::{EngineStates, Policy, Request};

pub const MAX_KEY_BYTES: usize = 128;
pub const IN_FLIGHT_CAP: u32 = 2;
/// Policies that honour a routing key of their own; smg leaves them unchanged too.
pub const OWN_KEY_POLICIES: [&str; 2] = ["manual", "consistent_hashing"];

fn strip_tag(key: &str, tag: u8) -> &str {
    let Some((head, tail)) = key.rsplit_once('_') else {
        return key;
    };
    match tail.as_bytes().split_first() {
        Some((&first, digits))
            if first == tag && !digits.is_empty() && digits.iter().all(u8::is_ascii_digit) =>
        {
            head
        }
        _ => key,
    }
}

/// `conv_t2_r1` -> `conv`: one `_r<n>`, then one `_t<n>`; all suffix keys as itself.
pub fn strip_lineage(key: &str) -> &str {
    let stripped = strip_tag(strip_tag(key, b'r'), b't');
    if stripped.is_empty() {
        key
    } else {
        stripped
    }
}

/// Non-empty UTF-8 of at most MAX_KEY_BYTES.
fn valid(bytes: &[u8]) -> Option<&str> {
    if bytes.is_empty() || bytes.len() > MAX_KEY_BYTES {
        return None;
    }
    std::str::from_utf8(bytes).ok()
}

struct Pin {
    engine: usize,
    last_used: f64,
}

pub struct StickyKeys {
    header_names: Vec<String>,
    max_idle: u64,
    /// The argument the policy reads the key material with (`PolicyState::reads_body`): the
    /// material is read once per request, so the rid must be read the same way.
    text_with_ids: bool,
    pins: HashMap<String, Pin>,
    in_flight: HashMap<(String, usize), u32>,
    now: f64,
}

impl StickyKeys {
    pub fn new(header_names: &[String], max_idle: u64, text_with_ids: bool) -> Self {
        Self {
            header_names: header_names
                .iter()
                .map(|n| n.to_ascii_lowercase())
                .collect(),
            max_idle,
            text_with_ids,
            pins: HashMap::new(),
            in_flight: HashMap::new(),
            now: 0.0,
        }
    }

    /// The request's sticky key, None when it has none.
    pub fn key_of(&self, request: &Request<'_>) -> Option<String> {
        if let Some(rid) = &request.material(self.text_with_ids).rid {
            // A rid that is not UTF-8 (a lone surrogate escaped) is no key, as in the twin.
            let rid = std::str::from_utf8(rid).ok()?;
            let key = strip_lineage(rid);
            return valid(key.as_bytes()).map(str::to_string);
        }
        self.header_names.iter().find_map(|name| {
            let value = valid(request.header(name)?)?;
            Some(strip_lineage(value).to_string())
        })
    }

    fn count(&self, key: &str, engine: usize) -> u32 {
        // The map is keyed by owned strings; a lookup builds one (keys are short).
        self.in_flight
            .get(&(key.to_string(), engine))
            .copied()
            .unwrap_or(0)
    }

    /// The engine for `request` and its sticky key (None: the policy's pick).
    pub fn pick(
        &mut self,
        request: &Request<'_>,
        engines: &mut EngineStates,
        policy: &mut dyn Policy,
    ) -> (usize, Option<String>) {
        let Some(key) = self.key_of(request) else {
            return (policy.pick(request, engines), None);
        };
        let pinned = self.pins.get(&key).map(|pin| pin.engine);
        if let Some(engine) = pinned.filter(|e| engines.candidates().contains(e)) {
            let under_cap = self.count(&key, engine) < IN_FLIGHT_CAP;
            let chosen = if under_cap {
                policy.record(engine, request, engines);
                engine
            } else {
                policy.pick(request, engines)
            };
            let moves = chosen != engine && self.count(&key, chosen) < IN_FLIGHT_CAP;
            if let Some(pin) = self.pins.get_mut(&key) {
                pin.last_used = self.now;
                if moves {
                    pin.engine = chosen;
                }
            }
            return (chosen, Some(key));
        }
        let chosen = policy.pick(request, engines);
        let now = self.now;
        self.pins.insert(
            key.clone(),
            Pin {
                engine: chosen,
                last_used: now,
            },
        );
        (chosen, Some(key))
    }

    pub fn started(&mut self, key: &str, engine: usize) {
        *self.in_flight.entry((key.to_string(), engine)).or_insert(0) += 1;
    }

    pub fn finished(&mut self, key: &str, engine: usize) {
        let slot = (key.to_string(), engine);
        match self.in_flight.get_mut(&slot) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                self.in_flight.remove(&slot);
            }
            None => {}
        }
    }

    pub fn evict(&mut self, now: f64) {
        self.now = now;
        if self.max_idle == 0 {
            return;
        }
        let max_idle = self.max_idle as f64;
        self.pins.retain(|_, pin| now - pin.last_used < max_idle);
    }
}

#[cfg(test)]
mod tests {
    use super::strip_lineage;

    #[test]
    fn lineage() {
        assert_eq!(strip_lineage("conv_t2_r1"), "conv");
        assert_eq!(strip_lineage("conv_t2"), "conv");
        assert_eq!(strip_lineage("conv_r3"), "conv");
        assert_eq!(strip_lineage("conv_r1_t2"), "conv_r1");
        assert_eq!(strip_lineage("_t1"), "_t1");
        assert_eq!(strip_lineage("conv_t"), "conv_t");
        assert_eq!(strip_lineage("conv_tx1"), "conv_tx1");
    }
}
