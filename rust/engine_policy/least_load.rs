//! least_load: the candidate of lowest expected wait from the engines' `GET /v1/loads`
//! reports, ties at random; `ExpectedWait` is the score power_of_two shares. The
//! specification, with the formula and its fallbacks: `policies/least_load.py`.

use super::{EngineStates, Options, Policy, Request, Rng};

/// The KV usage the barrier is clamped to: k/(1-k) would be infinite at 1.
const MAX_TOKEN_USAGE: f64 = 0.999;

/// The expected-wait score (seconds; lower is better) and the since-report credit.
pub struct ExpectedWait {
    kv_weight: f64,
    default_throughput: f64,
    mean_prefill: u64,
}

impl ExpectedWait {
    pub fn new(options: &Options) -> Self {
        Self {
            kv_weight: options.least_load_kv_pressure_weight,
            default_throughput: options.least_load_default_throughput,
            mean_prefill: options.least_load_mean_prefill_tokens,
        }
    }

    /// The score of each candidate, in candidate order. Every operation in the twin's
    /// order, so the floats (and hence the ties) are bit for bit the Python twin's.
    pub fn scores(&self, engines: &EngineStates, candidates: &[usize]) -> Vec<f64> {
        let reporting = candidates.iter().filter_map(|&i| engines.loads[i].as_ref());
        let mut any = false;
        let (mut sum, mut count) = (0.0f64, 0u64);
        for report in reporting {
            any = true;
            if report.throughput > 0.0 {
                sum += report.throughput;
                count += 1;
            }
        }
        if !any {
            return candidates
                .iter()
                .map(|&i| engines.in_flight[i] as f64)
                .collect();
        }
        let nominal = if count > 0 {
            sum / count as f64
        } else {
            self.default_throughput
        };
        candidates
            .iter()
            .map(|&i| match &engines.loads[i] {
                None => engines.in_flight[i].saturating_mul(self.mean_prefill) as f64 / nominal,
                Some(report) => {
                    let rate = if report.throughput > 0.0 {
                        report.throughput
                    } else {
                        self.default_throughput
                    };
                    let k = report.token_usage.clamp(0.0, MAX_TOKEN_USAGE);
                    // An engine that reports a queue but not its tokens is not idle.
                    let queued = if report.waiting_tokens > 0 {
                        report.waiting_tokens
                    } else {
                        report.waiting_reqs.saturating_mul(self.mean_prefill)
                    };
                    let work = queued.saturating_add(engines.since_tokens[i]);
                    work as f64 / rate + self.kv_weight * k / (1.0 - k)
                }
            })
            .collect()
    }

    /// `request` went to `index`: count it until the engine's next report (only while it
    /// has one). Without a request only the request count moves.
    pub fn credit(&self, engines: &mut EngineStates, index: usize, request: Option<&Request<'_>>) {
        if engines.loads[index].is_none() {
            return;
        }
        engines.since_reqs[index] = engines.since_reqs[index].saturating_add(1);
        if let Some(request) = request {
            let tokens = match &request.material(false).ids {
                Some(ids) if !ids.is_empty() => ids.len() as u64,
                _ => self.mean_prefill,
            };
            engines.since_tokens[index] = engines.since_tokens[index].saturating_add(tokens);
        }
    }
}

pub struct LeastLoad {
    scorer: ExpectedWait,
    cap: u64,
    rng: Rng,
}

impl LeastLoad {
    pub fn new(options: &Options, seed: u64) -> Self {
        Self {
            scorer: ExpectedWait::new(options),
            cap: options.least_load_max_waiting_requests,
            rng: Rng::new(seed),
        }
    }

    fn eligible(&self, engines: &EngineStates) -> Vec<usize> {
        let candidates = engines.candidates();
        if self.cap == 0 {
            return candidates;
        }
        let under: Vec<usize> = candidates
            .iter()
            .copied()
            .filter(|&i| match &engines.loads[i] {
                None => true,
                Some(r) => r.waiting_reqs.saturating_add(engines.since_reqs[i]) < self.cap,
            })
            .collect();
        if under.is_empty() {
            candidates
        } else {
            under
        }
    }
}

impl Policy for LeastLoad {
    fn pick(&mut self, request: &Request<'_>, engines: &mut EngineStates) -> usize {
        let candidates = self.eligible(engines);
        let scores = self.scorer.scores(engines, &candidates);
        let (mut best, mut best_score, mut tied) = (candidates[0], scores[0], 1usize);
        for (&index, &score) in candidates.iter().zip(&scores).skip(1) {
            if score < best_score {
                (best, best_score, tied) = (index, score, 1);
            } else if score == best_score {
                // Keep each tied candidate with probability 1/tied: uniform over the ties.
                tied += 1;
                if self.rng.below(tied) == 0 {
                    best = index;
                }
            }
        }
        self.scorer.credit(engines, best, Some(request));
        best
    }

    fn record(&mut self, index: usize, request: &Request<'_>, engines: &mut EngineStates) {
        self.scorer.credit(engines, index, Some(request));
    }
}
