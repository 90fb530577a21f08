//! round_robin: the candidates in turn (the front's behaviour before policies existed).

use super::{EngineStates, Policy, Request};

#[derive(Default)]
pub struct RoundRobin {
    turn: usize,
}

impl Policy for RoundRobin {
    fn pick(&mut self, _request: &Request<'_>, engines: &mut EngineStates) -> usize {
        let candidates = engines.candidates();
        let turn = self.turn;
        self.turn = self.turn.wrapping_add(1);
        candidates[turn % candidates.len()]
    }
}
