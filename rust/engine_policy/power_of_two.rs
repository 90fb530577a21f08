//! power_of_two: two distinct random candidates, the less loaded (the first drawn on a tie)
//! by `power_of_two_load_metric`: least_load's expected wait once either has a `/v1/loads`
//! report (else the `/get_load` figure, else requests in flight), the reported requests,
//! or requests in flight; as `policies/power_of_two.py`.

use super::least_load::ExpectedWait;
use super::{EngineStates, Options, Policy, Request, Rng};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Metric {
    ExpectedWait,
    Requests,
    LeastRequests,
}

pub struct PowerOfTwo {
    rng: Rng,
    metric: Metric,
    scorer: ExpectedWait,
}

impl PowerOfTwo {
    pub fn new(options: &Options, seed: u64) -> Self {
        let metric = match options.power_of_two_load_metric.as_str() {
            "requests" => Metric::Requests,
            "least_requests" => Metric::LeastRequests,
            _ => Metric::ExpectedWait, // checked by `Options::check`
        };
        Self {
            rng: Rng::new(seed),
            metric,
            scorer: ExpectedWait::new(options),
        }
    }
}

fn requests(engines: &EngineStates, index: usize) -> u64 {
    match &engines.loads[index] {
        None => engines.reported_load(index),
        Some(r) => r
            .running_reqs
            .saturating_add(r.waiting_reqs)
            .saturating_add(engines.since_reqs[index]),
    }
}

impl Policy for PowerOfTwo {
    fn pick(&mut self, request: &Request<'_>, engines: &mut EngineStates) -> usize {
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
        match self.metric {
            Metric::LeastRequests => {
                if engines.in_flight[a] <= engines.in_flight[b] {
                    a
                } else {
                    b
                }
            }
            Metric::ExpectedWait if engines.loads[a].is_none() && engines.loads[b].is_none() => {
                if engines.reported_load(a) <= engines.reported_load(b) {
                    a
                } else {
                    b
                }
            }
            Metric::ExpectedWait => {
                let scores = self.scorer.scores(engines, &[a, b]);
                let best = if scores[0] <= scores[1] { a } else { b };
                self.scorer.credit(engines, best, Some(request));
                best
            }
            Metric::Requests => {
                let best = if requests(engines, a) <= requests(engines, b) {
                    a
                } else {
                    b
                };
                self.scorer.credit(engines, best, None);
                best
            }
        }
    }

    fn record(&mut self, index: usize, request: &Request<'_>, engines: &mut EngineStates) {
        match self.metric {
            Metric::ExpectedWait => self.scorer.credit(engines, index, Some(request)),
            Metric::Requests => self.scorer.credit(engines, index, None),
            Metric::LeastRequests => {}
        }
    }
}
