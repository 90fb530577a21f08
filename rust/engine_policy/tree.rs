//! The approximate prefix tree of cache_aware (`policies/tree.py`): one radix tree whose
//! nodes record which engines were sent the prefix ending there, and when (a counter of
//! inserts), and which of them answered a request carrying it (prefilled it). Nodes live in an arena; a node's id is its creation number, which with the time
//! orders the trim exactly as the Python twin does.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

const ROOT: usize = 0;
const NONE: usize = usize::MAX;

struct Node {
    edge: Vec<u32>,
    parent: usize,
    id: u64,
    children: HashMap<u32, usize>,
    /// (engine, time of the last insert through this node for it)
    tenants: Vec<(usize, u64)>,
    /// The tenants that answered a request whose prompt ran through the whole node.
    prefilled: Vec<usize>,
}

impl Node {
    fn time_of(&self, engine: usize) -> Option<u64> {
        self.tenants
            .iter()
            .find(|(e, _)| *e == engine)
            .map(|&(_, t)| t)
    }

    fn has(&self, engine: usize) -> bool {
        self.tenants.iter().any(|(e, _)| *e == engine)
    }

    fn touch(&mut self, engine: usize, now: u64) -> bool {
        match self.tenants.iter_mut().find(|(e, _)| *e == engine) {
            Some(slot) => {
                slot.1 = now;
                false
            }
            None => {
                self.tenants.push((engine, now));
                true
            }
        }
    }
}

pub struct PrefixTree {
    nodes: Vec<Node>,
    free: Vec<usize>,
    /// Units held per engine.
    pub size: Vec<u64>,
}

/// How many leading units of `edge` equal `units`'.
fn shared(edge: &[u32], units: &[u32]) -> usize {
    // The common case, a whole edge matched, is one slice comparison (memcmp).
    if units.len() >= edge.len() && units[..edge.len()] == *edge {
        return edge.len();
    }
    edge.iter()
        .zip(units)
        .position(|(a, b)| a != b)
        .unwrap_or_else(|| edge.len().min(units.len()))
}

impl PrefixTree {
    pub fn new(engines: usize, ids: &mut u64) -> Self {
        let root = Node {
            edge: Vec::new(),
            parent: NONE,
            id: next_id(ids),
            children: HashMap::new(),
            tenants: Vec::new(),
            prefilled: Vec::new(),
        };
        Self {
            nodes: vec![root],
            free: Vec::new(),
            size: vec![0; engines],
        }
    }

    fn alloc(&mut self, node: Node) -> usize {
        match self.free.pop() {
            Some(slot) => {
                self.nodes[slot] = node;
                slot
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        }
    }

    /// The nodes `units` runs through, each with the units matched down to it.
    pub fn walk(&self, units: &[u32]) -> Vec<(usize, usize)> {
        let mut path = Vec::new();
        let (mut node, mut i) = (ROOT, 0);
        while i < units.len() {
            let Some(&child) = self.nodes[node].children.get(&units[i]) else {
                break;
            };
            let edge = &self.nodes[child].edge;
            let common = shared(edge, &units[i..]);
            i += common;
            path.push((i, child));
            if common < edge.len() {
                break;
            }
            node = child;
        }
        path
    }

    /// The engines at `node` with their times.
    pub fn tenants(&self, node: usize) -> &[(usize, u64)] {
        &self.nodes[node].tenants
    }

    /// Whether `engine` answered a request whose prompt ran through the whole `node`.
    pub fn prefilled(&self, node: usize, engine: usize) -> bool {
        self.nodes[node].prefilled.contains(&engine)
    }

    /// The units of `units` that `engine` holds: down to the deepest node on their path it
    /// prefilled (`held` of the twin).
    pub fn held(&self, units: &[u32], engine: usize) -> u64 {
        self.walk(units)
            .iter()
            .rev()
            .find(|&&(_, node)| self.prefilled(node, engine))
            .map_or(0, |&(matched, _)| matched as u64)
    }

    /// `engine` answered a request with prompt `units`: the nodes the prompt runs through
    /// whole, where the engine is a tenant, are prefilled there (`mark_prefilled` of the twin).
    pub fn mark_prefilled(&mut self, units: &[u32], engine: usize) {
        let mut start = 0;
        for (matched, node) in self.walk(units) {
            let n = &mut self.nodes[node];
            if matched - start < n.edge.len() || !n.has(engine) {
                break;
            }
            if !n.prefilled.contains(&engine) {
                n.prefilled.push(engine);
            }
            start = matched;
        }
    }

    /// Record that `engine` was sent `units`; the units it newly holds.
    pub fn insert(&mut self, units: &[u32], engine: usize, now: u64, ids: &mut u64) -> u64 {
        let (mut node, mut i, mut added) = (ROOT, 0usize, 0u64);
        while i < units.len() {
            let first = units[i];
            let Some(&found) = self.nodes[node].children.get(&first) else {
                let leaf = Node {
                    edge: units[i..].to_vec(),
                    parent: node,
                    id: next_id(ids),
                    children: HashMap::new(),
                    tenants: vec![(engine, now)],
                    prefilled: Vec::new(),
                };
                let leaf = self.alloc(leaf);
                self.nodes[node].children.insert(first, leaf);
                added += (units.len() - i) as u64;
                break;
            };
            let mut child = found;
            let common = shared(&self.nodes[child].edge, &units[i..]);
            if common < self.nodes[child].edge.len() {
                // Split: the shared part becomes a node of its own, held by the same engines.
                let rest = self.nodes[child].edge.split_off(common);
                let head = std::mem::replace(&mut self.nodes[child].edge, rest);
                let middle = Node {
                    edge: head,
                    parent: node,
                    id: next_id(ids),
                    children: HashMap::new(),
                    tenants: self.nodes[child].tenants.clone(),
                    prefilled: self.nodes[child].prefilled.clone(),
                };
                let middle = self.alloc(middle);
                let rest_first = self.nodes[child].edge[0];
                self.nodes[child].parent = middle;
                self.nodes[middle].children.insert(rest_first, child);
                self.nodes[node].children.insert(first, middle);
                child = middle;
            }
            let len = self.nodes[child].edge.len();
            if self.nodes[child].touch(engine, now) {
                added += len as u64;
            }
            i += len;
            node = child;
        }
        self.size[engine] += added;
        added
    }

    fn is_leaf_of(&self, node: usize, engine: usize) -> bool {
        let n = &self.nodes[node];
        n.has(engine) && !n.children.values().any(|&c| self.nodes[c].has(engine))
    }

    /// Drop `engine`'s least recently used leaves until it holds at most `max_size` units;
    /// the units dropped.
    pub fn evict(&mut self, engine: usize, max_size: u64) -> u64 {
        if self.size[engine] <= max_size {
            return 0;
        }
        let mut heap = BinaryHeap::new();
        let mut stack: Vec<usize> = self.nodes[ROOT].children.values().copied().collect();
        while let Some(node) = stack.pop() {
            let Some(time) = self.nodes[node].time_of(engine) else {
                continue;
            };
            if self.is_leaf_of(node, engine) {
                heap.push(Reverse((time, self.nodes[node].id, node)));
            }
            stack.extend(self.nodes[node].children.values().copied());
        }
        let mut dropped = 0;
        while self.size[engine] > max_size {
            let Some(Reverse((_, _, node))) = heap.pop() else {
                break;
            };
            let len = self.nodes[node].edge.len() as u64;
            self.nodes[node].tenants.retain(|(e, _)| *e != engine);
            self.nodes[node].prefilled.retain(|e| *e != engine);
            self.size[engine] -= len;
            dropped += len;
            let parent = self.nodes[node].parent;
            if self.nodes[node].tenants.is_empty() && parent != NONE {
                let first = self.nodes[node].edge[0];
                self.nodes[parent].children.remove(&first);
                self.nodes[node] = Node {
                    edge: Vec::new(),
                    parent: NONE,
                    id: 0,
                    children: HashMap::new(),
                    tenants: Vec::new(),
                    prefilled: Vec::new(),
                };
                self.free.push(node);
            }
            if parent != NONE && parent != ROOT && self.is_leaf_of(parent, engine) {
                if let Some(time) = self.nodes[parent].time_of(engine) {
                    heap.push(Reverse((time, self.nodes[parent].id, parent)));
                }
            }
        }
        dropped
    }
}

fn next_id(ids: &mut u64) -> u64 {
    let id = *ids;
    *ids += 1;
    id
}
