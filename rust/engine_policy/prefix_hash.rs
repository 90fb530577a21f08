//! prefix_hash: the prompt's head (`X-SMG-Routing-Key`, else its first token ids, else four
//! times as many characters of its text) hashed onto a consistent-hash ring of the engines,
//! walking on past engines that are down or overloaded; as `policies/prefix_hash.py`.

use super::{least, EngineStates, Options, Policy, Request, ROUTING_KEY_HEADER};
use crate::hash::blake2b64;

/// Points per engine on the ring.
const VNODES: usize = 160;
/// Characters of text that stand for one token.
const CHARS_PER_TOKEN: usize = 4;

pub struct PrefixHash {
    count: usize,
    factor: f64,
    abs_threshold: u64,
    /// The URLs the ring was built for (on the first pick; again if they change).
    ring_urls: Vec<String>,
    /// (point, engine index), sorted.
    ring: Vec<(u64, usize)>,
}

impl PrefixHash {
    pub fn new(options: &Options) -> Self {
        Self {
            count: usize::try_from(options.prefix_token_count).unwrap_or(usize::MAX),
            factor: options.prefix_hash_load_factor,
            abs_threshold: options.prefix_hash_balance_abs_threshold,
            ring_urls: Vec::new(),
            ring: Vec::new(),
        }
    }

    fn build_ring(&mut self, urls: &[String]) {
        if self.ring_urls == urls {
            return;
        }
        let mut ring = Vec::with_capacity(urls.len() * VNODES);
        for (index, url) in urls.iter().enumerate() {
            for j in 0..VNODES {
                ring.push((blake2b64(format!("{url}#{j}").as_bytes()), index));
            }
        }
        ring.sort_unstable();
        self.ring = ring;
        self.ring_urls = urls.to_vec();
    }

    /// The bytes hashed onto the ring, None when the request has nothing to hash.
    fn key(&self, request: &Request<'_>) -> Option<Vec<u8>> {
        if let Some(key) = request.header(ROUTING_KEY_HEADER) {
            return Some(key.to_vec());
        }
        let material = request.material(false);
        if let Some(ids) = material.ids.as_ref().filter(|ids| !ids.is_empty()) {
            let head = &ids[..ids.len().min(self.count)];
            return Some(head.iter().flat_map(|id| id.to_le_bytes()).collect());
        }
        if material.text.is_empty() {
            return None;
        }
        let chars = self.count.saturating_mul(CHARS_PER_TOKEN);
        let head = &material.text[..material.text.len().min(chars)];
        let mut out = Vec::with_capacity(head.len());
        for &cp in head {
            push_utf8(&mut out, cp);
        }
        Some(out)
    }
}

/// One code point as UTF-8, a lone surrogate too (as Python's "surrogatepass").
fn push_utf8(out: &mut Vec<u8>, cp: u32) {
    // The masks keep every byte in range; code points are at most 0x10FFFF.
    match cp {
        0..=0x7F => out.push(cp as u8),
        0x80..=0x7FF => out.extend([0xC0 | (cp >> 6) as u8, 0x80 | (cp & 0x3F) as u8]),
        0x800..=0xFFFF => out.extend([
            0xE0 | (cp >> 12) as u8,
            0x80 | ((cp >> 6) & 0x3F) as u8,
            0x80 | (cp & 0x3F) as u8,
        ]),
        _ => out.extend([
            0xF0 | ((cp >> 18) & 0x07) as u8,
            0x80 | ((cp >> 12) & 0x3F) as u8,
            0x80 | ((cp >> 6) & 0x3F) as u8,
            0x80 | (cp & 0x3F) as u8,
        ]),
    }
}

impl Policy for PrefixHash {
    fn pick(&mut self, request: &Request<'_>, engines: &mut EngineStates) -> usize {
        let candidates = engines.candidates();
        let Some(key) = self.key(request) else {
            return least(&candidates, |i| engines.in_flight[i])[0];
        };
        self.build_ring(&engines.urls);
        let load = &engines.in_flight;
        let total = candidates
            .iter()
            .fold(0u64, |sum, &i| sum.saturating_add(load[i]));
        let avg = total.saturating_add(1) as f64 / candidates.len() as f64;
        let limit = (avg * self.factor).max(avg + self.abs_threshold as f64);
        let mut allowed = vec![false; engines.len()];
        for &i in &candidates {
            allowed[i] = true;
        }
        let hash = blake2b64(&key);
        let start = self.ring.partition_point(|&(point, _)| point < hash);
        let mut seen = vec![false; engines.len()];
        let (mut met, mut first) = (0usize, None);
        let n = self.ring.len();
        for step in 0..n {
            let owner = self.ring[(start + step) % n].1;
            if !allowed[owner] || seen[owner] {
                continue;
            }
            if total == 0 || load[owner] as f64 <= limit {
                return owner;
            }
            first.get_or_insert(owner);
            seen[owner] = true;
            met += 1;
            if met == candidates.len() {
                break;
            }
        }
        first.unwrap_or(candidates[0])
    }
}
