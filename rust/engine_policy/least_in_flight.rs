//! least_in_flight: the fewest requests in flight (the rollout framework's router rule);
//! ties to the lowest index, or to the tied engines in turn.

use super::{least, EngineStates, Policy, Request};

pub struct LeastInFlight {
    rotate: bool,
    turn: usize,
}

impl LeastInFlight {
    pub fn new(tie_break: &str) -> Self {
        Self {
            rotate: tie_break == "round_robin",
            turn: 0,
        }
    }
}

impl Policy for LeastInFlight {
    fn pick(&mut self, _request: &Request<'_>, engines: &mut EngineStates) -> usize {
        let tied = least(&engines.candidates(), |i| engines.in_flight[i]);
        if !self.rotate {
            return tied[0];
        }
        let turn = self.turn;
        self.turn = self.turn.wrapping_add(1);
        tied[turn % tied.len()]
    }
}
