//! Counters of the compiled front, updated lock-free from the tokio threads and read by
//! `CompiledFront.stats()`.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Status codes an HTTP/1.1 reply can carry (hyper accepts 100..=999 from upstreams).
const STATUS_SLOTS: usize = 1000;

pub struct Stats {
    statuses: Box<[AtomicU64]>,
    /// Histogram bounds in seconds, ascending.
    bounds: Vec<f64>,
    /// Observations per bucket (not cumulative); the last slot is above every bound.
    buckets: Box<[AtomicU64]>,
    count: AtomicU64,
    sum_ns: AtomicU64,
    handoffs: AtomicU64,
    connections: AtomicI64,
}

/// What `stats()` reports, copied out of the atomics.
pub struct Snapshot {
    pub requests: Vec<(u16, u64)>,
    /// Cumulative: observations `<=` each bound.
    pub buckets: Vec<u64>,
    pub count: u64,
    pub sum_seconds: f64,
    pub handoffs: u64,
    pub connections: i64,
}

impl Stats {
    pub fn new(bounds: Vec<f64>) -> Self {
        let slots = |n: usize| (0..n).map(|_| AtomicU64::new(0)).collect();
        let buckets = slots(bounds.len() + 1);
        Self {
            statuses: slots(STATUS_SLOTS),
            bounds,
            buckets,
            count: AtomicU64::new(0),
            sum_ns: AtomicU64::new(0),
            handoffs: AtomicU64::new(0),
            connections: AtomicI64::new(0),
        }
    }

    /// One reply written: its status, and the time since its head was parsed if known.
    pub fn record(&self, status: u16, latency: Option<Duration>) {
        if let Some(slot) = self.statuses.get(usize::from(status)) {
            slot.fetch_add(1, Relaxed);
        }
        if let Some(elapsed) = latency {
            let seconds = elapsed.as_secs_f64();
            let index = self.bounds.partition_point(|&b| b < seconds);
            self.buckets[index].fetch_add(1, Relaxed);
            self.count.fetch_add(1, Relaxed);
            let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
            self.sum_ns.fetch_add(ns, Relaxed);
        }
    }

    pub fn handoff(&self) {
        self.handoffs.fetch_add(1, Relaxed);
    }

    pub fn connection_opened(&self) {
        self.connections.fetch_add(1, Relaxed);
    }

    pub fn connection_closed(&self) {
        self.connections.fetch_sub(1, Relaxed);
    }

    pub fn connections(&self) -> i64 {
        self.connections.load(Relaxed)
    }

    pub fn snapshot(&self) -> Snapshot {
        let requests = self
            .statuses
            .iter()
            .enumerate()
            .filter_map(|(code, n)| {
                let n = n.load(Relaxed);
                (n > 0).then(|| (u16::try_from(code).unwrap_or(0), n))
            })
            .collect();
        let mut running = 0;
        let buckets = self.buckets[..self.bounds.len()]
            .iter()
            .map(|b| {
                running += b.load(Relaxed);
                running
            })
            .collect();
        Snapshot {
            requests,
            buckets,
            count: self.count.load(Relaxed),
            sum_seconds: self.sum_ns.load(Relaxed) as f64 / 1e9,
            handoffs: self.handoffs.load(Relaxed),
            connections: self.connections(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative_and_inclusive() {
        let stats = Stats::new(vec![0.1, 1.0]);
        stats.record(200, Some(Duration::from_millis(100)));
        stats.record(200, Some(Duration::from_millis(500)));
        stats.record(502, Some(Duration::from_secs(3)));
        stats.record(408, None);
        let snap = stats.snapshot();
        assert_eq!(snap.buckets, vec![1, 2]);
        assert_eq!(snap.count, 3);
        assert_eq!(snap.requests, vec![(200, 2), (408, 1), (502, 1)]);
        assert!((snap.sum_seconds - 3.6).abs() < 1e-9);
    }
}
