//! power_of_two: two distinct random candidates, the less loaded (the first drawn on a tie);
//! load is the engine's reported `/get_load`, else its requests in flight.

use super::{EngineStates, Policy, Request, Rng};

pub struct PowerOfTwo {
    rng: Rng,
}

impl PowerOfTwo {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: Rng::new(seed),
        }
    }
}

impl Policy for PowerOfTwo {
    fn pick(&mut self, _request: &Request<'_>, engines: &mut EngineStates) -> usize {
        let candidates = engines.candidates();
        let n = candidates.len();
        if n == 1 {
            return candidates[0];
        }
        let first = self.rng.below(n);
        let mut second = self.rng.below(n - 1);
        if second >= first {
            second += 1;
        }
        let (a, b) = (candidates[first], candidates[second]);
        if engines.reported_load(a) <= engines.reported_load(b) {
            a
        } else {
            b
        }
    }
}
