//! The upstream engines of the front: one pooled keep-alive HTTP/1.1 client each, the engine
//! routing policy choosing among them (`rust/engine_policy/`, cache_aware by default), retries
//! with backoff after a connect failure or a 429 / 503 reply head, a circuit breaker per
//! engine (`reliability.rs`), and health with failure / success thresholds. The probes
//! themselves are the process's engine registry's (`engines/registry.py`): one prober per
//! engine per process, whose verdicts arrive through `probed_url`. Mirrors
//! `python/sessiongate/engines/pool.py` and `client.py` for stateless traffic.

use std::error::Error as StdError;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue, ACCEPT_ENCODING};
use hyper::http::uri::{Authority, PathAndQuery, Scheme};
use hyper::{HeaderMap, Method, Request, Response, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, Error as ClientError};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::sync::watch;

use super::failure::{
    connect_failed_text, connect_timed_out, retry_target, transport_error_text, url_hostname,
};
use super::hop::{connection_named, forwarded};
use super::reliability::{
    jitter_sample, retryable_status, state_name, Breaker, Config, HealthCounter, OPEN,
};
use super::siblings::{self, PromptKey, Role, Siblings};
use crate::cached_tokens::CachedTokens;
use crate::engine_policy::{LoadReport, Material, PolicyState, Request as RoutingRequest};
use crate::hash::rendezvous_weight;

pub type Body = Full<Bytes>;

/// How long an idle pooled upstream connection is kept.
const POOL_IDLE: Duration = Duration::from_secs(90);

/// One upstream base URL, validated: `http://authority[/prefix]`, no trailing "/".
#[derive(Debug, Clone)]
pub struct Target {
    pub url: String,
    authority: Authority,
    prefix: String,
}

/// Parse one base URL as the Python side accepts it, or say what is wrong with it.
pub fn parse_url(raw: &str) -> Result<Target, String> {
    let url = raw.trim_end_matches('/');
    let Some(rest) = url.strip_prefix("http://") else {
        return Err(format!(
            "upstream URL '{raw}' is not http:// (the compiled front speaks plain HTTP to upstreams)"
        ));
    };
    let (authority, prefix) = match rest.find('/') {
        Some(slash) => rest.split_at(slash),
        None => (rest, ""),
    };
    let invalid = |why: &str| format!("upstream URL '{raw}' is invalid: {why}");
    if authority.is_empty() || authority.contains('@') {
        return Err(invalid("it needs a host[:port] (without user info)"));
    }
    let authority: Authority = authority
        .parse()
        .map_err(|e| invalid(&format!("bad host[:port] ({e})")))?;
    if prefix.contains(['?', '#'])
        || (!prefix.is_empty() && prefix.parse::<PathAndQuery>().is_err())
    {
        return Err(invalid("the path prefix is not a plain URL path"));
    }
    Ok(Target {
        url: url.to_string(),
        authority,
        prefix: prefix.to_string(),
    })
}

/// The request headers as forwarded: `accept-encoding: identity` first, then the client's
/// minus the hop-by-hop ones (`hop.rs`) and `authorization` when the gateway checks its own
/// key. None when one cannot be represented (the Python server then deals with the request).
pub fn forward_headers<'h, I>(headers: I, drop_authorization: bool) -> Option<HeaderMap>
where
    I: ExactSizeIterator<Item = (&'h str, &'h [u8])> + Clone,
{
    let named = connection_named(headers.clone().map(|(k, v)| (k.as_bytes(), v)));
    let mut map = HeaderMap::with_capacity(headers.len() + 1);
    // Replies are relayed verbatim, so never ask for compression.
    map.insert(ACCEPT_ENCODING, HeaderValue::from_static("identity"));
    for (name, value) in headers {
        let dropped = !forwarded(name.as_bytes(), &named)
            || (drop_authorization && name.eq_ignore_ascii_case("authorization"));
        if !dropped {
            let name = HeaderName::from_bytes(name.as_bytes()).ok()?;
            map.append(name, HeaderValue::from_bytes(value).ok()?);
        }
    }
    Some(map)
}

struct Upstream {
    target: Target,
    client: Client<HttpConnector, Body>,
    healthy: AtomicBool,
    /// Why it was last marked down (kept until it is up again).
    last_error: Mutex<Option<String>>,
    /// Requests sent to it (every attempt, retries included): `/metrics`' per-engine counter.
    sent: AtomicU64,
    breaker: Mutex<Breaker>,
    probes: Mutex<HealthCounter>,
    /// Retries this engine caused (its connect errors, 429s and 503s).
    retries: AtomicU64,
    /// Prompt tokens it was believed to hold and had lost, as replies' cached_tokens showed.
    lost: AtomicU64,
}

/// One request to relay upstream.
pub struct Outgoing {
    pub method: Method,
    /// The target's path and query (query only when non-empty).
    pub path_and_query: PathAndQuery,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// What `stats()` shows of an upstream.
pub struct UpstreamState {
    pub url: String,
    pub healthy: bool,
    pub last_error: Option<String>,
    /// Requests in flight on it, as the engine policy counts them (pick to relayed reply).
    pub in_flight: u64,
    pub sent: u64,
    pub circuit_breaker: &'static str,
    pub retries: u64,
    /// Prompt tokens it was believed to hold and had lost (`Upstream::lost`).
    pub lost: u64,
}

pub struct Pool {
    upstreams: Vec<Upstream>,
    /// The engine routing policy and the engines' states it decides on (in flight, health).
    state: Mutex<PolicyState>,
    /// `PolicyState::reads_body`, known up front so the body is scanned outside the lock.
    reads_body: Option<bool>,
    created: Instant,
    /// Rendezvous order of the key "" over the URLs: where a failed request retries.
    retry_order: Vec<usize>,
    timeout: Duration,
    connect_timeout: Duration,
    /// Replaced by a new engine set: its trim loop ends at its next wake-up;
    /// requests still on it finish.
    retired: AtomicBool,
    reliability: Config,
    /// Whether some breaker is open: only then does a pick look for due half-opens.
    any_open: AtomicBool,
    /// Requests with one prompt on one engine, prefilled there once (`siblings.rs`); None
    /// under `--no-hold-siblings`.
    siblings: Option<Siblings>,
    /// `PolicyState::learns_prefills`: whether an answered request's body goes back to the
    /// policy (cache_aware counts a sent prefix as held once an engine answered it).
    learns_prefills: bool,
}

enum Failure {
    /// Nothing was sent: a retry elsewhere is safe.
    Connect(String),
    Other(String),
}

impl Pool {
    /// Needs a tokio runtime context (the clients' pool timers).
    pub fn new(
        targets: Vec<Target>,
        timeout: Duration,
        connect_timeout: Duration,
        state: PolicyState,
        reliability: Config,
    ) -> Result<Self, String> {
        Self::build(targets, timeout, connect_timeout, state, reliability, None)
    }

    /// The pool of a new engine set, with this one's settings and policy (its state starts
    /// afresh, as `pool.py::set_urls` does); engines in both sets keep their connections and
    /// health. Needs a tokio runtime context.
    pub fn successor(&self, targets: Vec<Target>) -> Result<Self, String> {
        let urls = targets.iter().map(|t| t.url.clone()).collect();
        let state = lock(&self.state).with_urls(urls)?;
        Self::build(
            targets,
            self.timeout,
            self.connect_timeout,
            state,
            self.reliability.clone(),
            Some(self),
        )
    }

    pub fn retire(&self) {
        self.retired.store(true, Relaxed);
    }

    fn build(
        targets: Vec<Target>,
        timeout: Duration,
        connect_timeout: Duration,
        mut state: PolicyState,
        reliability: Config,
        previous: Option<&Pool>,
    ) -> Result<Self, String> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(connect_timeout));
        let mut upstreams = Vec::with_capacity(targets.len());
        let mut any_open = false;
        for target in targets {
            let kept =
                previous.and_then(|p| p.upstreams.iter().find(|u| u.target.url == target.url));
            // A kept engine keeps its connections, health, breaker and probe streak, and its
            // counters carry on (a Prometheus counter never goes back).
            let (client, healthy, last_error, sent, breaker, probes, retries) = match kept {
                Some(up) => (
                    up.client.clone(),
                    up.healthy.load(Relaxed),
                    lock(&up.last_error).clone(),
                    up.sent.load(Relaxed),
                    lock(&up.breaker).clone(),
                    lock(&up.probes).clone(),
                    up.retries.load(Relaxed),
                ),
                None => (
                    Client::builder(TokioExecutor::new())
                        .pool_idle_timeout(POOL_IDLE)
                        .pool_timer(TokioTimer::new())
                        .build(connector.clone()),
                    // Assumed up until a probe or a request says otherwise (as pool.py).
                    true,
                    None,
                    0,
                    reliability.breaker(),
                    HealthCounter::default(),
                    0,
                ),
            };
            any_open |= breaker.is_open();
            state.set_healthy(upstreams.len(), healthy && !breaker.is_open());
            upstreams.push(Upstream {
                target,
                client,
                healthy: AtomicBool::new(healthy),
                last_error: Mutex::new(last_error),
                sent: AtomicU64::new(sent),
                breaker: Mutex::new(breaker),
                probes: Mutex::new(probes),
                retries: AtomicU64::new(retries),
                lost: AtomicU64::new(kept.map_or(0, |up| up.lost.load(Relaxed))),
            });
        }
        let weights: Vec<u64> = upstreams
            .iter()
            .map(|u| rendezvous_weight(b"", &u.target.url))
            .collect();
        let mut retry_order: Vec<usize> = (0..upstreams.len()).collect();
        // Highest weight first.
        retry_order.sort_by(|&a, &b| weights[b].cmp(&weights[a]));
        Ok(Self {
            upstreams,
            siblings: state.holds_siblings().then(Siblings::default),
            reads_body: state.reads_body(),
            learns_prefills: state.learns_prefills(),
            state: Mutex::new(state),
            // The breakers' clock: a successor keeps it, as it keeps their states.
            created: previous.map_or_else(Instant::now, |p| p.created),
            retry_order,
            timeout,
            connect_timeout,
            retired: AtomicBool::new(false),
            reliability,
            any_open: AtomicBool::new(any_open),
        })
    }

    /// Seconds on the breakers' clock.
    fn now(&self) -> f64 {
        self.created.elapsed().as_secs_f64()
    }

    pub fn states(&self) -> Vec<UpstreamState> {
        let in_flight = lock(&self.state).engines.in_flight.clone();
        let now = self.now();
        self.upstreams
            .iter()
            .enumerate()
            .map(|(index, u)| UpstreamState {
                url: u.target.url.clone(),
                healthy: u.healthy.load(Relaxed),
                last_error: lock(&u.last_error).clone(),
                in_flight: in_flight.get(index).copied().unwrap_or(0),
                sent: u.sent.load(Relaxed),
                circuit_breaker: state_name(lock(&u.breaker).state(now)),
                retries: u.retries.load(Relaxed),
                lost: u.lost.load(Relaxed),
            })
            .collect()
    }

    /// Record upstream `index` as up (`error` None) or down because of `error`, as a real
    /// request found it (the probes' streak starts again).
    fn mark(&self, index: usize, error: Option<String>) {
        lock(&self.upstreams[index].probes).reset();
        self.set_health(index, error);
    }

    fn set_health(&self, index: usize, error: Option<String>) {
        let upstream = &self.upstreams[index];
        let mut last = lock(&upstream.last_error);
        upstream.healthy.store(error.is_none(), Relaxed);
        let available = error.is_none() && lock(&upstream.breaker).allows(self.now());
        lock(&self.state).set_healthy(index, available);
        *last = error;
    }

    /// A probe's verdict on the engine at `url` (the registry's prober, `CompiledFront.probed`):
    /// false when no engine of this set has that URL.
    pub fn probed_url(&self, url: &str, error: Option<String>) -> bool {
        match self.upstreams.iter().position(|u| u.target.url == url) {
            Some(index) => {
                self.probed(index, error);
                true
            }
            None => false,
        }
    }

    /// A load report for the engine at `url` (`CompiledFront.loads`): false when no engine
    /// of this set has that URL.
    pub fn loads_url(&self, url: &str, report: Option<LoadReport>) -> bool {
        match self.upstreams.iter().position(|u| u.target.url == url) {
            Some(index) => {
                lock(&self.state).set_loads(index, report);
                true
            }
            None => false,
        }
    }

    /// One probe's verdict: it flips the engine's health only at its threshold.
    fn probed(&self, index: usize, error: Option<String>) {
        let upstream = &self.upstreams[index];
        let healthy = upstream.healthy.load(Relaxed);
        let up = lock(&upstream.probes).probe(error.is_none(), healthy, &self.reliability);
        if up != healthy {
            self.set_health(index, if up { None } else { error });
        } else if !up && error.is_some() {
            *lock(&upstream.last_error) = error; // still down: the latest reason
        } else if up && error.is_none() {
            *lock(&upstream.last_error) = None;
        }
    }

    /// Count one attempt's outcome in engine `index`'s breaker; the policy learns when the
    /// engine leaves or rejoins the candidates.
    fn outcome(&self, index: usize, success: bool) {
        let upstream = &self.upstreams[index];
        let now = self.now();
        let (before, after) = {
            let mut breaker = lock(&upstream.breaker);
            let before = breaker.state(now);
            (before, breaker.record(success, now))
        };
        if before == after {
            return;
        }
        if after == OPEN {
            self.any_open.store(true, Relaxed);
        }
        let available = after != OPEN && upstream.healthy.load(Relaxed);
        lock(&self.state).set_healthy(index, available);
    }

    /// Open breakers past their timeout let trial requests through again.
    fn half_open_due(&self) {
        if !self.any_open.load(Relaxed) {
            return;
        }
        let now = self.now();
        let mut still_open = false;
        for (index, upstream) in self.upstreams.iter().enumerate() {
            let mut breaker = lock(&upstream.breaker);
            let was_open = breaker.is_open();
            let open = breaker.state(now) == OPEN;
            drop(breaker);
            still_open |= open;
            if was_open && !open {
                lock(&self.state).set_healthy(index, upstream.healthy.load(Relaxed));
            }
        }
        self.any_open.store(still_open, Relaxed);
    }

    fn available(&self, index: usize) -> bool {
        let upstream = &self.upstreams[index];
        upstream.healthy.load(Relaxed) && lock(&upstream.breaker).allows(self.now())
    }

    /// A reply proves the upstream reachable; a 5xx proves nothing (an engine loading).
    fn answered(&self, index: usize, status: u16) {
        if status < 500 && !self.upstreams[index].healthy.load(Relaxed) {
            self.mark(index, None);
        }
    }

    /// The policy's engine for `request`, counted in flight until the guard drops.
    fn pick(self: &Arc<Self>, headers: &HeaderMap, body: &Bytes) -> InFlight {
        self.half_open_due();
        let view = RoutingRequest::new(headers, body);
        if let Some(text_with_ids) = self.reads_body {
            // The scan of a large body must not hold the other front threads up.
            view.material(text_with_ids);
        }
        let (index, key, held) = {
            let mut state = lock(&self.state);
            let (index, key) = state.pick_keyed(&view);
            // The belief at the pick, which the reply's cached_tokens is held against: by
            // the reply, requests admitted with it may have been answered.
            let held = if self.learns_prefills {
                state.held(index, &view)
            } else {
                None
            };
            (index, key, held)
        };
        let mut guard = self.in_flight(index, key);
        if self.learns_prefills {
            // Kept for `prefilled` at the answer, so the body is not read twice.
            guard.material = view.into_material();
            guard.held = held;
        }
        guard
    }

    /// `key`: the request's sticky key, counted on the engine with it.
    fn in_flight(self: &Arc<Self>, index: usize, key: Option<String>) -> InFlight {
        lock(&self.state).started(index, key.as_deref());
        self.upstreams[index].sent.fetch_add(1, Relaxed);
        InFlight {
            pool: Arc::clone(self),
            index,
            key,
            sibling: None,
            material: None,
            held: None,
            cached: None,
            answered: false,
        }
    }

    /// Siblings' figures: (siblings held, leads held, leads followed, warm-ups, warm-ups
    /// failed); zeros when off.
    pub fn sibling_counts(&self) -> (u64, u64, u64, u64, u64) {
        self.siblings.as_ref().map_or((0, 0, 0, 0, 0), |s| {
            (
                s.held.load(Relaxed),
                s.leads_held.load(Relaxed),
                s.leads_followed.load(Relaxed),
                s.warmups.load(Relaxed),
                s.failed.load(Relaxed),
            )
        })
    }

    /// Wait while the request's prompt is warmed up on its engine (`siblings.rs`); the
    /// guard leaves the prompt's entry when dropped.
    async fn hold_sibling(
        self: &Arc<Self>,
        guard: &mut InFlight,
        prompt: &Arc<PromptKey>,
        headers: &HeaderMap,
    ) {
        let Some(table) = self.siblings.as_ref() else {
            return;
        };
        let index = guard.index;
        guard.sibling = Some(Arc::clone(prompt));
        let mut role = table.enter(index, prompt);
        if let Role::Follow(anchor) = role {
            siblings::wait_warmed(anchor).await;
            role = table.resume(index, prompt);
        }
        let warmed = match role {
            Role::Go | Role::Follow(_) => return,
            Role::Wait(warmed) => warmed,
            Role::WarmUp(warmed) => {
                let pool = Arc::clone(self);
                let key = Arc::clone(prompt);
                let auth = headers.get(hyper::header::AUTHORIZATION).cloned();
                tokio::spawn(async move {
                    let took = pool.warm_up(index, &key, auth).await;
                    if let Some(table) = pool.siblings.as_ref() {
                        table.warmed(index, &key, took);
                    }
                });
                warmed
            }
        };
        siblings::wait_warmed(warmed).await;
    }

    /// Send engine `index` the prompt's warm-up; whether it answered 200.
    async fn warm_up(&self, index: usize, key: &PromptKey, auth: Option<HeaderValue>) -> bool {
        let mut headers = HeaderMap::new();
        headers.insert(
            hyper::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(auth) = auth {
            headers.insert(hyper::header::AUTHORIZATION, auth);
        }
        let path = PathAndQuery::from_static(siblings::GENERATE_PATH);
        let body = Bytes::from(siblings::warmup_body(key));
        match self
            .attempt(index, &Method::POST, &path, headers, body)
            .await
        {
            Ok(reply) => {
                let ok = reply.status() == hyper::StatusCode::OK;
                // Read to the end, so the connection goes back to the pool.
                let _ = http_body_util::BodyExt::collect(reply.into_body()).await;
                ok
            }
            Err(_) => false,
        }
    }

    /// Seconds between the policy's trims, None when it keeps nothing to trim.
    pub fn eviction_interval(&self) -> Option<Duration> {
        lock(&self.state)
            .eviction_interval()
            .map(Duration::from_secs)
    }

    /// Trim the policy's state every `interval`, until shutdown.
    pub async fn evict_forever(
        self: Arc<Self>,
        interval: Duration,
        mut shutdown: watch::Receiver<bool>,
    ) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = shutdown.wait_for(|stopping| *stopping) => return,
            }
            if self.retired.load(Relaxed) {
                return;
            }
            let now = self.created.elapsed().as_secs_f64();
            lock(&self.state).evict(now);
        }
    }

    /// Where to retry after `failed` could not be connected to (`failure.rs`).
    fn retry_target(&self, failed: usize) -> Option<usize> {
        retry_target(&self.retry_order, failed, |i| self.available(i))
    }

    /// Send `request` and wait for the reply head; Err is the 502 message. A connect failure
    /// (nothing sent) or a 429 / 503 head (refused before any work) is sent again after a
    /// backoff, up to the configured attempts: a connect failure elsewhere (`retry_target`),
    /// a refusal where the policy picks. The reply comes with its engine's in-flight guard:
    /// keep it until the body is relayed.
    pub async fn send(
        self: &Arc<Self>,
        request: Outgoing,
    ) -> Result<(Response<Incoming>, InFlight), String> {
        if self.upstreams.is_empty() {
            // Python keeps relaying off while the set is empty; this is the backstop.
            return Err("no engine registered yet".into());
        }
        let attempts = self.reliability.attempts();
        let Outgoing {
            method,
            path_and_query,
            mut headers,
            body,
        } = request;
        let mut guard = self.pick(&headers, &body);
        let prompt = match self.siblings {
            Some(_) => siblings::prompt_key(method.as_str(), path_and_query.path(), &body),
            None => None,
        }
        .map(Arc::new);
        let mut attempt: u32 = 0;
        loop {
            let last = attempt + 1 >= attempts;
            if let Some(prompt) = prompt.as_ref() {
                self.hold_sibling(&mut guard, prompt, &headers).await;
            }
            let index = guard.index;
            // The last attempt takes the headers; earlier ones need a copy for the next.
            let sent = if last {
                std::mem::take(&mut headers)
            } else {
                headers.clone()
            };
            let connect_failed = match self
                .attempt(index, &method, &path_and_query, sent, body.clone())
                .await
            {
                Ok(reply) if last || !retryable_status(reply.status().as_u16()) => {
                    guard.answered = reply.status() == hyper::StatusCode::OK;
                    return Ok((reply, guard));
                }
                // Only the head was read: nothing of it reached the client.
                Ok(_refused) => false,
                Err(Failure::Other(message)) => return Err(message),
                Err(Failure::Connect(message)) if last => return Err(message),
                Err(Failure::Connect(_)) => true,
            };
            self.upstreams[index].retries.fetch_add(1, Relaxed);
            let key = guard.key.clone();
            let material = guard.material.take();
            drop(guard);
            let delay = self.reliability.backoff_ms(attempt, jitter_sample());
            tokio::time::sleep(Duration::from_millis(delay)).await;
            attempt += 1;
            // After a connect failure another engine when there is one; after a refusal
            // wherever the policy picks now.
            let elsewhere = connect_failed.then(|| self.retry_target(index)).flatten();
            guard = match elsewhere {
                Some(retry) => {
                    let mut guard = self.in_flight(retry, key);
                    guard.material = material;
                    guard
                }
                None => self.pick(&headers, &body),
            };
        }
    }

    async fn attempt(
        &self,
        index: usize,
        method: &Method,
        path_and_query: &PathAndQuery,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<Response<Incoming>, Failure> {
        let upstream = &self.upstreams[index];
        let message = |kind: &str, detail: &str| {
            let path = path_and_query.path();
            transport_error_text(method.as_str(), &upstream.target.url, path, kind, detail)
        };
        let uri = upstream
            .uri(path_and_query)
            .map_err(|e| Failure::Other(message("InvalidURL", &e)))?;
        let mut request = Request::new(Full::new(body));
        *request.method_mut() = method.clone();
        *request.uri_mut() = uri;
        *request.headers_mut() = headers;
        match tokio::time::timeout(self.timeout, upstream.client.request(request)).await {
            // hyper skips interim replies but returns a 101, which the front never asks for.
            Ok(Ok(reply)) if reply.status() == hyper::StatusCode::SWITCHING_PROTOCOLS => {
                Err(Failure::Other(message(
                    "ProtocolFailure",
                    "upstream answered 101 Switching Protocols, but no upgrade was asked for",
                )))
            }
            Ok(Ok(reply)) => {
                let status = reply.status().as_u16();
                // A 5xx counts against the engine's breaker, a 4xx is the client's doing.
                self.outcome(index, status < 500);
                self.answered(index, status);
                Ok(reply)
            }
            Ok(Err(error)) => {
                self.outcome(index, false);
                let (kind, detail) = describe(&error, &upstream.target, self.connect_timeout);
                let text = message(kind, &detail);
                self.mark(index, Some(text.clone()));
                Err(if error.is_connect() {
                    Failure::Connect(text)
                } else {
                    Failure::Other(text)
                })
            }
            // A slow engine is not a gone one: the prober decides (pool.py); its breaker
            // counts the failure.
            Err(_) => {
                self.outcome(index, false);
                Err(Failure::Other(message("TimeoutError", "timed out")))
            }
        }
    }
}

/// A request counted in flight on engine `index` until dropped.
pub struct InFlight {
    pool: Arc<Pool>,
    index: usize,
    key: Option<String>,
    /// The prompt it holds an entry of in the pool's siblings, if any.
    sibling: Option<Arc<PromptKey>>,
    /// The request's key material as its pick read it, when the policy learns from answers
    /// (`Pool::learns_prefills`).
    material: Option<Material>,
    /// What the policy believed its engine held of the prompt at the pick (`Policy::held`),
    /// when it learns from replies' `cached_tokens`.
    held: Option<u64>,
    /// The reply's `cached_tokens`, read as it was relayed.
    cached: Option<u64>,
    /// Whether its engine answered with a 200: told to the policy when the reply is relayed.
    answered: bool,
}

impl InFlight {
    /// A watch for the reply's `cached_tokens` when the policy would learn from it.
    pub fn cached_watch(&self) -> Option<CachedTokens> {
        (self.answered && self.held.is_some()).then(CachedTokens::new)
    }

    /// The reply's `cached_tokens`, told to the policy when the guard drops.
    pub fn set_cached(&mut self, cached: Option<u64>) {
        self.cached = cached;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let (Some(prompt), Some(table)) = (self.sibling.take(), self.pool.siblings.as_ref()) {
            table.leave(self.index, &prompt);
        }
        if let (true, Some(material)) = (self.answered, self.material.take()) {
            let headers = HeaderMap::new();
            let view = RoutingRequest::with_material(&headers, &[], material);
            let mut state = lock(&self.pool.state);
            if let (Some(held), Some(cached)) = (self.held, self.cached) {
                let lost = state.cached(self.index, &view, held, cached);
                self.pool.upstreams[self.index]
                    .lost
                    .fetch_add(lost, Relaxed);
            }
            state.prefilled(self.index, &view);
        }
        lock(&self.pool.state).finished(self.index, self.key.as_deref());
    }
}

impl Upstream {
    fn uri(&self, path_and_query: &PathAndQuery) -> Result<Uri, String> {
        let path_and_query = if self.target.prefix.is_empty() {
            path_and_query.clone()
        } else {
            format!("{}{path_and_query}", self.target.prefix)
                .parse()
                .map_err(|e| format!("{e}"))?
        };
        let mut parts = hyper::http::uri::Parts::default();
        parts.scheme = Some(Scheme::HTTP);
        parts.authority = Some(self.target.authority.clone());
        parts.path_and_query = Some(path_and_query);
        Uri::from_parts(parts).map_err(|e| format!("{e}"))
    }
}

/// A mutex whose holder panicked still holds a valid string: keep using it.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The first error of type `T` in `error`'s source chain.
fn find<'e, T: StdError + 'static>(error: &'e (dyn StdError + 'static)) -> Option<&'e T> {
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(found) = e.downcast_ref::<T>() {
            return Some(found);
        }
        current = e.source();
    }
    None
}

/// An OS error as Python words it ("[Errno 111] Connection refused").
fn io_text(error: &io::Error) -> String {
    let text = error.to_string();
    match error.raw_os_error() {
        Some(code) => {
            let suffix = format!(" (os error {code})");
            format!(
                "[Errno {code}] {}",
                text.strip_suffix(&suffix).unwrap_or(&text)
            )
        }
        None => text,
    }
}

/// The exception-like kind and detail of a failed exchange, for the 502 and probe messages.
fn describe(
    error: &(dyn StdError + 'static),
    target: &Target,
    connect_timeout: Duration,
) -> (&'static str, String) {
    if find::<ClientError>(error).is_some_and(ClientError::is_connect) {
        let port = target.authority.port_u16().unwrap_or(80);
        let why = match find::<io::Error>(error) {
            Some(e) if e.kind() == io::ErrorKind::TimedOut => {
                connect_timed_out(connect_timeout.as_secs_f64())
            }
            Some(e) => io_text(e),
            None => innermost(error),
        };
        let host = url_hostname(target.authority.host());
        return ("ConnectFailed", connect_failed_text(&host, port, &why));
    }
    if let Some(e) = find::<io::Error>(error) {
        return ("ConnectionError", io_text(e));
    }
    if let Some(e) = find::<hyper::Error>(error) {
        return ("RemoteProtocolError", e.to_string());
    }
    ("HttpError", innermost(error))
}

fn innermost(error: &(dyn StdError + 'static)) -> String {
    let mut current = error;
    while let Some(next) = current.source() {
        current = next;
    }
    current.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_validated_like_the_python_side() {
        let t = parse_url("http://127.0.0.1:8000/").map_err(|e| e.to_string());
        assert_eq!(
            t.as_ref().map(|t| t.url.as_str()),
            Ok("http://127.0.0.1:8000")
        );
        let t = parse_url("http://h:1/pfx//").map_err(|e| e.to_string());
        assert_eq!(t.as_ref().map(|t| t.prefix.as_str()), Ok("/pfx"));
        for bad in [
            "https://h:1",
            "h:1",
            "",
            "http://",
            "http:///x",
            "http://u@h:1",
            "http://h:1/a?b",
        ] {
            let err = parse_url(bad).err().unwrap_or_default();
            assert!(err.contains(&format!("'{bad}'")), "{bad}: {err}");
        }
    }

    #[test]
    fn forwarded_headers_drop_hop_by_hop_ones() {
        let headers = [
            ("Host", &b"front"[..]),
            ("Content-Type", b"application/json"),
            ("Connection", b"keep-alive"),
            ("Accept-Encoding", b"gzip"),
            ("Authorization", b"Bearer k"),
            ("X-Trace", b"1"),
            ("x-trace", b"2"),
        ];
        let map = forward_headers(headers.iter().copied(), true).unwrap_or_default();
        let got: Vec<(String, Vec<u8>)> = map
            .iter()
            .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
            .collect();
        let want = [
            ("accept-encoding", &b"identity"[..]),
            ("content-type", b"application/json"),
            ("x-trace", b"1"),
            ("x-trace", b"2"),
        ];
        let want: Vec<(String, Vec<u8>)> = want
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_vec()))
            .collect();
        assert_eq!(got, want);
        let kept = forward_headers(headers.iter().copied(), false).unwrap_or_default();
        assert!(kept.contains_key("authorization"));
    }

    #[test]
    fn retry_order_is_rendezvous_of_the_empty_key() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build();
        let Ok(rt) = rt else { return };
        let _guard = rt.enter();
        let urls = ["http://a:1", "http://b:2", "http://c:3"];
        let targets = urls.iter().filter_map(|u| parse_url(u).ok()).collect();
        let state = PolicyState::new(
            "round_robin",
            urls.iter().map(|u| u.to_string()).collect(),
            Default::default(),
        );
        let Ok(state) = state else {
            panic!("policy state")
        };
        let pool = Pool::new(
            targets,
            Duration::from_secs(1),
            Duration::from_secs(1),
            state,
            Config::default(),
        );
        let Ok(pool) = pool else { panic!("pool") };
        let pool = Arc::new(pool);
        let mut by_weight: Vec<(u64, usize)> = urls
            .iter()
            .enumerate()
            .map(|(i, u)| (crate::hash::blake2b64(format!("\0{u}").as_bytes()), i))
            .collect();
        by_weight.sort_unstable_by(|a, b| b.cmp(a));
        let order: Vec<usize> = by_weight.iter().map(|&(_, i)| i).collect();
        assert_eq!(pool.retry_order, order);
        assert_eq!(pool.retry_target(order[0]), Some(order[1]));
        assert_eq!(pool.retry_target(order[1]), Some(order[0]));
        pool.mark(order[0], Some("down".into()));
        assert_eq!(pool.retry_target(order[1]), Some(order[2]));
        // Round robin skips the unhealthy one, and counts its picks in flight until dropped.
        let request = Outgoing {
            method: Method::POST,
            path_and_query: PathAndQuery::from_static("/v1/completions"),
            headers: HeaderMap::new(),
            body: Bytes::new(),
        };
        let guards: Vec<InFlight> = (0..4)
            .map(|_| pool.pick(&request.headers, &request.body))
            .collect();
        assert!(!guards.iter().any(|g| g.index == order[0]));
        assert_eq!(lock(&pool.state).engines.in_flight.iter().sum::<u64>(), 4);
        // The states /metrics reads: per engine in flight now, and sent in all.
        let states = pool.states();
        assert_eq!(states.iter().map(|s| s.in_flight).sum::<u64>(), 4);
        assert_eq!(states.iter().map(|s| s.sent).sum::<u64>(), 4);
        assert_eq!(states[order[0]].sent, 0);
        drop(guards);
        assert_eq!(lock(&pool.state).engines.in_flight.iter().sum::<u64>(), 0);
        let states = pool.states();
        assert_eq!(states.iter().map(|s| s.in_flight).sum::<u64>(), 0);
        assert_eq!(states.iter().map(|s| s.sent).sum::<u64>(), 4);
    }
}
