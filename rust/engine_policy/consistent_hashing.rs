//! consistent_hashing: `X-SMG-Target-Worker`, else a key (`X-SMG-Routing-Key`, else
//! Authorization / X-Forwarded-For / Cookie) in rendezvous order over the engine URLs, else
//! a random candidate; as `policies/consistent_hashing.py`.

use super::{
    EngineStates, Policy, Request, Rng, IMPLICIT_KEY_HEADERS, ROUTING_KEY_HEADER,
    TARGET_WORKER_HEADER,
};
use crate::hash::rendezvous_weight;

pub struct ConsistentHashing {
    rng: Rng,
}

impl ConsistentHashing {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: Rng::new(seed),
        }
    }
}

fn target(value: &[u8]) -> Option<usize> {
    if value.is_empty() || value.len() >= 19 || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(
        value
            .iter()
            .fold(0usize, |v, &d| v * 10 + usize::from(d - b'0')),
    )
}

impl Policy for ConsistentHashing {
    fn pick(&mut self, request: &Request<'_>, engines: &mut EngineStates) -> usize {
        if let Some(index) = request.header(TARGET_WORKER_HEADER).and_then(target) {
            if index < engines.len() && engines.healthy[index] {
                return index;
            }
        }
        let candidates = engines.candidates();
        let key = request
            .header(ROUTING_KEY_HEADER)
            .or_else(|| IMPLICIT_KEY_HEADERS.iter().find_map(|h| request.header(h)));
        let Some(key) = key else {
            return candidates[self.rng.below(candidates.len())];
        };
        // Highest weight first; the lower index on a (practically impossible) tie.
        let mut best = candidates[0];
        let mut best_weight = rendezvous_weight(key, &engines.urls[best]);
        for &i in &candidates[1..] {
            let w = rendezvous_weight(key, &engines.urls[i]);
            if w > best_weight {
                best = i;
                best_weight = w;
            }
        }
        best
    }
}
