//! manual: sticky routing by `X-SMG-Routing-Key`, as `policies/manual.py`: a new key goes
//! where `assignment_mode` says, each key remembers its last two engines, a request without
//! the key goes to a random candidate, idle keys are forgotten by `evict`.

use std::collections::HashMap;

use super::{least, EngineStates, Options, Policy, Request, Rng, ROUTING_KEY_HEADER};

const MAX_CANDIDATES: usize = 2;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Random,
    MinLoad,
    MinGroup,
}

struct Assignment {
    engines: Vec<usize>,
    last_used: f64,
}

pub struct Manual {
    mode: Mode,
    max_idle: u64,
    rng: Rng,
    keys: HashMap<Vec<u8>, Assignment>,
    /// Keys whose latest engine is each engine (min_group's measure).
    groups: Vec<u64>,
    now: f64,
}

impl Manual {
    pub fn new(options: &Options, engines: usize, seed: u64) -> Self {
        let mode = match options.assignment_mode.as_str() {
            "min_load" => Mode::MinLoad,
            "min_group" => Mode::MinGroup,
            _ => Mode::Random,
        };
        Self {
            mode,
            max_idle: options.max_idle_secs,
            rng: Rng::new(seed),
            keys: HashMap::new(),
            groups: vec![0; engines],
            now: 0.0,
        }
    }

    fn new_engine(&mut self, candidates: &[usize], engines: &EngineStates) -> usize {
        let tied = match self.mode {
            Mode::Random => return candidates[self.rng.below(candidates.len())],
            Mode::MinLoad => least(candidates, |i| engines.in_flight[i]),
            Mode::MinGroup => least(candidates, |i| self.groups[i]),
        };
        if tied.len() > 1 {
            tied[self.rng.below(tied.len())]
        } else {
            tied[0]
        }
    }
}

impl Policy for Manual {
    fn pick(&mut self, request: &Request<'_>, engines: &mut EngineStates) -> usize {
        let candidates = engines.candidates();
        let Some(key) = request.header(ROUTING_KEY_HEADER) else {
            return candidates[self.rng.below(candidates.len())];
        };
        let now = self.now;
        let known = match self.keys.get_mut(key) {
            Some(assignment) => {
                assignment.last_used = now;
                if let Some(&engine) = assignment.engines.iter().find(|e| candidates.contains(e)) {
                    return engine;
                }
                true
            }
            None => false,
        };
        let engine = self.new_engine(&candidates, engines);
        if !known {
            self.keys.insert(
                key.to_vec(),
                Assignment {
                    engines: vec![engine],
                    last_used: now,
                },
            );
            self.groups[engine] += 1;
            return engine;
        }
        if let Some(assignment) = self.keys.get_mut(key) {
            if let Some(&latest) = assignment.engines.last() {
                self.groups[latest] = self.groups[latest].saturating_sub(1);
            }
            if assignment.engines.len() >= MAX_CANDIDATES {
                assignment.engines.remove(0);
            }
            assignment.engines.push(engine);
            self.groups[engine] += 1;
        }
        engine
    }

    fn evict(&mut self, now: f64) {
        self.now = now;
        if self.max_idle == 0 {
            return;
        }
        let max_idle = self.max_idle as f64;
        let groups = &mut self.groups;
        self.keys.retain(|_, a| {
            let keep = now - a.last_used < max_idle;
            if !keep {
                if let Some(&latest) = a.engines.last() {
                    groups[latest] = groups[latest].saturating_sub(1);
                }
            }
            keep
        });
    }
}
