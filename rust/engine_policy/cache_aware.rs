//! cache_aware and cache_aware_gateway: follow the engines' prefix caches while the load is
//! balanced; the twin of `policies/cache_aware.py`, whose docstring says how sessiongate's
//! variant departs from the SGLang Model Gateway's.

use std::borrow::Cow;
use std::collections::HashMap;

use super::tree::PrefixTree;
use super::{least, EngineStates, Material, Options, Policy, Request};

/// What a unit to prefill costs against a unit of work in flight (`cache_aware.py` says why).
const PREFILL_WEIGHT: u64 = 4;

/// How far below the units an engine was believed to hold a reply's `cached_tokens` may be
/// before the belief counts as wrong (`cache_aware.py` says why).
const CACHED_SLACK: u64 = 64;

/// (token ids?, adapter, extra_key): one tree each.
type TreeKey = (bool, Option<Vec<u8>>, Option<Vec<u8>>);

pub struct CacheAware {
    gateway: bool,
    threshold: f64,
    balance_abs: u64,
    balance_rel: f64,
    max_tree_size: u64,
    engines: usize,
    trees: HashMap<TreeKey, PrefixTree>,
    /// Units held per engine, over all trees.
    total: Vec<u64>,
    clock: u64,
    ids: u64,
}

/// The Gateway's routing text: the text, else the token ids printed and space-joined.
fn gateway_units(material: &Material) -> Vec<u32> {
    match &material.ids {
        Some(ids) if material.text.is_empty() => {
            let mut out = Vec::with_capacity(ids.len() * 6);
            for (n, id) in ids.iter().enumerate() {
                if n > 0 {
                    out.push(u32::from(b' '));
                }
                out.extend(id.to_string().bytes().map(u32::from));
            }
            out
        }
        _ => material.text.clone(),
    }
}

impl CacheAware {
    pub fn new(options: &Options, engines: usize, gateway: bool) -> Self {
        Self {
            gateway,
            threshold: options.cache_threshold,
            balance_abs: options.balance_abs_threshold,
            balance_rel: options.balance_rel_threshold,
            max_tree_size: options.max_tree_size,
            engines,
            trees: HashMap::new(),
            total: vec![0; engines],
            clock: 0,
            ids: 0,
        }
    }

    /// The tree a request's prefixes live in and the units it is matched by, for `pick` and
    /// `record` alike (`_key` in `cache_aware.py`).
    fn key<'m>(&self, material: &'m Material) -> (TreeKey, Cow<'m, [u32]>) {
        if self.gateway {
            return ((false, None, None), Cow::Owned(gateway_units(material)));
        }
        let key = (
            material.ids.is_some(),
            material.adapter.clone(),
            material.extra_key.clone(),
        );
        (
            key,
            Cow::Borrowed(material.ids.as_deref().unwrap_or(&material.text)),
        )
    }

    fn ratio(&self, matched: usize, units: &[u32]) -> bool {
        matched as f64 / units.len() as f64 > self.threshold
    }

    fn gateway_choice(&self, tree: &PrefixTree, units: &[u32], candidates: &[usize]) -> usize {
        if let Some(&(matched, node)) = tree.walk(units).last() {
            if self.ratio(matched, units) {
                // The engine sent this prefix last.
                if let Some(&(engine, _)) = tree.tenants(node).iter().max_by_key(|(_, t)| *t) {
                    return engine;
                }
            }
        }
        least(candidates, |i| self.total[i])[0]
    }

    /// The units each candidate would prefill: the prompt less the deepest prefix the
    /// engine holds, when that is over `cache_threshold` of the prompt. An engine holds what
    /// it prefilled, or the whole prompt once sent it (`_uncached` of the twin says why).
    fn uncached(&self, tree: &PrefixTree, units: &[u32], candidates: &[usize]) -> Vec<u64> {
        let mut uncached = vec![units.len() as u64; self.engines];
        let mut seen = vec![false; self.engines];
        let path = tree.walk(units);
        let whole = path
            .last()
            .is_some_and(|&(matched, _)| matched == units.len());
        for (depth, &(matched, node)) in path.iter().rev().enumerate() {
            let tenants = tree.tenants(node);
            for &i in candidates {
                if seen[i] || !tenants.iter().any(|(e, _)| *e == i) {
                    continue;
                }
                // A prefix counts once prefilled; the whole prompt once sent (a sibling).
                let held = tree.prefilled(node, i) || (depth == 0 && whole);
                if !held {
                    continue;
                }
                seen[i] = true;
                if self.ratio(matched, units) {
                    uncached[i] = (units.len() - matched) as u64;
                }
            }
        }
        uncached
    }
}

impl Policy for CacheAware {
    fn pick(&mut self, request: &Request<'_>, engines: &mut EngineStates) -> usize {
        let candidates = engines.candidates();
        let (key, units) = self.key(request.material(self.gateway));
        let units: &[u32] = &units;
        let mut ids = self.ids;
        let engine_count = self.engines;
        let tree = self
            .trees
            .remove(&key)
            .unwrap_or_else(|| PrefixTree::new(engine_count, &mut ids));
        let loads = candidates.iter().map(|&i| engines.in_flight[i]);
        let low = loads.clone().min().unwrap_or(0);
        let high = loads.max().unwrap_or(0);
        let imbalanced =
            high - low > self.balance_abs && high as f64 > low as f64 * self.balance_rel;
        let chosen = if self.gateway {
            let chosen = if imbalanced {
                least(&candidates, |i| engines.in_flight[i])[0]
            } else {
                self.gateway_choice(&tree, units, &candidates)
            };
            if !candidates.contains(&chosen) {
                // The Gateway sends the request to its first healthy engine, unrecorded.
                self.ids = ids;
                self.trees.insert(key, tree);
                return candidates[0];
            }
            chosen
        } else {
            let uncached = self.uncached(&tree, units, &candidates);
            let chosen = if imbalanced {
                least(&candidates, |i| engines.in_flight[i])[0]
            } else {
                let cost = |i: usize| {
                    (
                        engines.work[i] + PREFILL_WEIGHT * uncached[i],
                        engines.in_flight[i],
                        self.total[i],
                        i,
                    )
                };
                candidates
                    .iter()
                    .copied()
                    .min_by_key(|&i| cost(i))
                    .unwrap_or(0)
            };
            // Counted from the pick: the caller reports the request's start right after.
            engines.work[chosen] += uncached[chosen] + 1;
            chosen
        };
        let mut tree = tree;
        self.clock += 1;
        self.total[chosen] += tree.insert(units, chosen, self.clock, &mut ids);
        self.ids = ids;
        self.trees.insert(key, tree);
        chosen
    }

    fn record(&mut self, index: usize, request: &Request<'_>, engines: &mut EngineStates) {
        let (key, units) = self.key(request.material(self.gateway));
        let units: &[u32] = &units;
        let mut ids = self.ids;
        let engine_count = self.engines;
        let mut tree = self
            .trees
            .remove(&key)
            .unwrap_or_else(|| PrefixTree::new(engine_count, &mut ids));
        if !self.gateway {
            let uncached = self.uncached(&tree, units, &[index]);
            engines.work[index] += uncached[index] + 1;
        }
        self.clock += 1;
        self.total[index] += tree.insert(units, index, self.clock, &mut ids);
        self.ids = ids;
        self.trees.insert(key, tree);
    }

    fn prefilled(&mut self, index: usize, request: &Request<'_>) {
        if self.gateway {
            return;
        }
        let (key, units) = self.key(request.material(self.gateway));
        if let Some(tree) = self.trees.get_mut(&key) {
            tree.mark_prefilled(&units, index);
        }
    }

    fn held(&self, index: usize, request: &Request<'_>) -> Option<u64> {
        let material = request.material(self.gateway);
        if self.gateway || material.ids.is_none() {
            return None;
        }
        let (key, units) = self.key(material);
        Some(
            self.trees
                .get(&key)
                .map_or(0, |tree| tree.held(&units, index)),
        )
    }

    fn cached(&mut self, index: usize, request: &Request<'_>, held: u64, cached: u64) -> u64 {
        if held <= cached + CACHED_SLACK
            || self.gateway
            || request.material(self.gateway).ids.is_none()
        {
            return 0;
        }
        let (key, units) = self.key(request.material(self.gateway));
        let mut ids = self.ids;
        if let Some(tree) = self.trees.get_mut(&key) {
            // The prompt is the engine's most recently used now, so the least recently
            // used units that go for what it lost are never the prompt's own.
            self.clock += 1;
            self.total[index] += tree.insert(&units, index, self.clock, &mut ids);
            let keep =
                (tree.size[index] - (held - cached).min(tree.size[index])).max(units.len() as u64);
            self.total[index] -= tree.evict(index, keep);
        }
        self.ids = ids;
        held - cached
    }

    fn evict(&mut self, _now: f64) {
        for tree in self.trees.values_mut() {
            for engine in 0..self.engines {
                self.total[engine] -= tree.evict(engine, self.max_tree_size);
            }
        }
    }
}
