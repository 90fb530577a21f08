//! random: a uniformly random candidate.

use super::{EngineStates, Policy, Request, Rng};

pub struct RandomPick {
    rng: Rng,
}

impl RandomPick {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: Rng::new(seed),
        }
    }
}

impl Policy for RandomPick {
    fn pick(&mut self, _request: &Request<'_>, engines: &mut EngineStates) -> usize {
        let candidates = engines.candidates();
        candidates[self.rng.below(candidates.len())]
    }
}
