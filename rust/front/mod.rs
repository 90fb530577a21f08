//! The compiled front door: an HTTP/1.1 server on tokio that owns the gateway's public
//! socket, relays stateless proxy requests upstream without Python, and hands every other
//! connection (fd plus the bytes already read) to the Python server. This file is the
//! Python API only; see `conn.rs` for the per-connection behaviour.

use std::os::fd::{AsRawFd, BorrowedFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};
use tokio::runtime::Runtime;
use tokio::sync::watch;

pub(crate) mod bulk;
mod conn;
mod dispatch;
pub(crate) mod failure;
mod head;
mod hop;
mod lend;
pub(crate) mod reliability;
mod reply;
mod route;
mod server;
pub(crate) mod siblings;
mod stats;
mod upstream;

use route::decide;
use server::{Config, Shared};
use stats::Stats;
use upstream::{parse_url, Pool};

use crate::engine_policy::{LoadReport, Options as EngineOptions, PolicyState};

/// Durations past this (including infinity) mean "no practical limit"; capped so deadline
/// arithmetic cannot overflow.
const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);
/// After the grace period, how long the runtime's blocking threads (DNS lookups) may take.
const RUNTIME_SHUTDOWN: Duration = Duration::from_millis(500);
/// How often `stop` looks whether the front's connections are all done.
const STOP_POLL: Duration = Duration::from_millis(2);
const MAX_THREADS: i64 = 1024;

struct Running {
    runtime: Runtime,
    shutdown: watch::Sender<bool>,
}

/// The front door; see `python/sessiongate/_core.pyi`.
#[pyclass(module = "sessiongate._core", frozen)]
pub struct CompiledFront {
    shared: Arc<Shared>,
    running: Mutex<Option<Running>>,
}

/// The engines' base URLs, parsed and distinct.
fn targets_of(urls: &[String]) -> PyResult<Vec<upstream::Target>> {
    let targets = urls
        .iter()
        .map(|u| parse_url(u))
        .collect::<Result<Vec<_>, _>>()
        .map_err(PyValueError::new_err)?;
    for (i, target) in targets.iter().enumerate() {
        if targets[..i].iter().any(|t| t.url == target.url) {
            return Err(PyValueError::new_err(format!(
                "upstream URLs must be distinct: '{}' is given twice",
                target.url
            )));
        }
    }
    Ok(targets)
}

fn seconds(name: &str, value: f64) -> PyResult<Duration> {
    if value.is_nan() || value <= 0.0 {
        return Err(PyValueError::new_err(format!(
            "{name} must be a positive number of seconds, got {value}"
        )));
    }
    Ok(Duration::try_from_secs_f64(value).map_or(MAX_DURATION, |d| d.min(MAX_DURATION)))
}

/// Our own duplicate of a descriptor the caller keeps (and closes when it wants).
fn dup_fd(name: &str, fd: RawFd) -> PyResult<OwnedFd> {
    if fd < 0 {
        return Err(PyValueError::new_err(format!(
            "{name} must be an open file descriptor, got {fd}"
        )));
    }
    // SAFETY: the descriptor is only used for this one dup (fcntl F_DUPFD_CLOEXEC); one that
    // is not open makes it fail with EBADF.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    borrowed
        .try_clone_to_owned()
        .map_err(|e| PyOSError::new_err(format!("cannot duplicate {name} {fd}: {e}")))
}

/// Whether `fd` is a listening socket (Linux says; elsewhere assumed).
fn is_listening(fd: &OwnedFd) -> bool {
    #[cfg(target_os = "linux")]
    {
        let mut value: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: a valid fd and an out-parameter of the size passed.
        let rc = unsafe {
            libc::getsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ACCEPTCONN,
                (&mut value as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        rc == 0 && value != 0
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = fd;
        true
    }
}

/// `str.lower()` of Python, so header names compare exactly as `routes.py` compares them.
fn py_lower<'py>(name: &Bound<'py, PyString>) -> PyResult<Bound<'py, PyAny>> {
    name.call_method0(intern!(name.py(), "lower"))
}

#[pymethods]
impl CompiledFront {
    #[new]
    #[pyo3(signature = (
        listen_fd, notify_fd, upstreams, *, max_body_bytes, api_key, session_headers,
        header_timeout, body_timeout, keepalive_timeout, upstream_timeout, connect_timeout,
        threads, latency_buckets, dispatch = false,
        engine_policy = "round_robin", engine_policy_options = None, reliability = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        listen_fd: RawFd,
        notify_fd: RawFd,
        upstreams: Vec<String>,
        max_body_bytes: i64,
        api_key: Option<String>,
        session_headers: Vec<Bound<'_, PyString>>,
        header_timeout: f64,
        body_timeout: f64,
        keepalive_timeout: f64,
        upstream_timeout: f64,
        connect_timeout: f64,
        threads: i64,
        latency_buckets: Vec<f64>,
        dispatch: bool,
        engine_policy: &str,
        engine_policy_options: Option<&Bound<'_, PyDict>>,
        reliability: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        // Everything is validated before a thread starts or an fd is taken.
        let targets = targets_of(&upstreams)?;
        let max_body = u64::try_from(max_body_bytes).map_err(|_| {
            PyValueError::new_err(format!("max_body_bytes must be >= 0, got {max_body_bytes}"))
        })?;
        if !(1..=MAX_THREADS).contains(&threads) {
            return Err(PyValueError::new_err(format!(
                "threads must be in 1..{MAX_THREADS}, got {threads}"
            )));
        }
        let ascending = latency_buckets.windows(2).all(|w| w[0] < w[1]);
        if !ascending || latency_buckets.iter().any(|b| b.is_nan()) {
            return Err(PyValueError::new_err(format!(
                "latency_buckets must be strictly ascending numbers, got {latency_buckets:?}"
            )));
        }
        let session_names = session_headers
            .iter()
            .map(|name| {
                let lowered = py_lower(name)?;
                let lowered = lowered.downcast::<PyString>()?;
                Ok(lowered.to_string_lossy().into_owned().into_bytes())
            })
            .collect::<PyResult<Vec<_>>>()?;
        let config = Config {
            max_body,
            api_key: api_key.map(String::into_bytes),
            session_names,
            header_timeout: seconds("header_timeout", header_timeout)?,
            header_timeout_text: reply::fmt_g(header_timeout),
            body_timeout: seconds("body_timeout", body_timeout)?,
            body_timeout_text: reply::fmt_g(body_timeout),
            keepalive_timeout: seconds("keepalive_timeout", keepalive_timeout)?,
            upstream_timeout: seconds("upstream_timeout", upstream_timeout)?,
            dispatch,
        };
        let connect_timeout = seconds("connect_timeout", connect_timeout)?;
        let options = EngineOptions::from_dict(engine_policy_options)?;
        let reliability = reliability::Config::from_dict(reliability)?;
        let urls = targets.iter().map(|t| t.url.clone()).collect();
        let state =
            PolicyState::new(engine_policy, urls, options).map_err(PyValueError::new_err)?;
        let pool = Pool::new(
            targets,
            config.upstream_timeout,
            connect_timeout,
            state,
            reliability,
        )
        .map_err(PyValueError::new_err)?;
        let threads = usize::try_from(threads).unwrap_or(1);

        let listen = dup_fd("listen_fd", listen_fd)?;
        if !is_listening(&listen) {
            return Err(PyValueError::new_err(format!(
                "listen_fd {listen_fd} is not a listening socket"
            )));
        }
        let listener = std::net::TcpListener::from(listen);
        if listener.local_addr().is_err() {
            return Err(PyValueError::new_err(format!(
                "listen_fd {listen_fd} is not a TCP socket"
            )));
        }
        listener.set_nonblocking(true)?;
        let notify = dup_fd("notify_fd", notify_fd)?;

        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("sg-front")
            .enable_all()
            .build()
            .map_err(|e| PyOSError::new_err(format!("cannot start the front's runtime: {e}")))?;
        let listener = {
            let _context = runtime.enter();
            tokio::net::TcpListener::from_std(listener)?
        };
        let pool = Arc::new(pool);
        let shared = Arc::new(Shared::new(
            config,
            Stats::new(latency_buckets),
            Arc::clone(&pool),
            notify,
        ));
        // No engine yet (they register at run time): Python answers stateless requests
        // until `set_engines`.
        shared.set_relay(!upstreams.is_empty());
        let (shutdown, stopping) = watch::channel(false);
        runtime.spawn(server::accept_loop(
            listener,
            Arc::clone(&shared),
            stopping.clone(),
        ));
        if let Some(interval) = pool.eviction_interval() {
            runtime.spawn(Arc::clone(&pool).evict_forever(interval, stopping));
        }
        Ok(Self {
            shared,
            running: Mutex::new(Some(Running { runtime, shutdown })),
        })
    }

    /// Drain the queued hand-offs: `(fd now owned by the caller, bytes already read)`.
    fn take_handoffs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for (fd, data) in self.shared.take_handoffs() {
            let data = PyBytes::new(py, &data);
            // The fd is released to Python only once its tuple exists.
            let item = PyTuple::new(
                py,
                [
                    fd.as_raw_fd().into_pyobject(py)?.into_any(),
                    data.into_any(),
                ],
            )?;
            list.append(item)?;
            let _ = fd.into_raw_fd();
        }
        Ok(list)
    }

    /// Drain the requests for Python to answer (`DispatchedRequest`), oldest first.
    fn take_requests(&self) -> Vec<dispatch::DispatchedRequest> {
        self.shared.take_requests()
    }

    /// Drain the ids of dispatched requests that may `send` again after a FULL.
    fn take_writable(&self) -> Vec<u64> {
        self.shared.take_writable()
    }

    /// Relay stateless proxy requests to the engines given at start (true, the default) or
    /// dispatch them to Python (false), once the engine set is managed at run time.
    fn set_relay(&self, relay: bool) {
        self.shared.set_relay(relay);
    }

    /// Relay stateless requests to `urls` from now on (the engine registry's set): the
    /// policy starts afresh over them, engines kept from the old set keep their
    /// connections and health, and requests in flight finish on the engines they had.
    fn set_engines(&self, urls: Vec<String>) -> PyResult<()> {
        if urls.is_empty() {
            return Err(PyValueError::new_err(
                "the compiled front needs at least one engine (set_relay(False) to hand \
                 stateless requests to Python instead)",
            ));
        }
        let targets = targets_of(&urls)?;
        let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let Some(running) = running.as_ref() else {
            return Err(PyValueError::new_err("the compiled front is stopped"));
        };
        let pool = {
            let _context = running.runtime.enter();
            self.shared.pool().successor(targets)
        }
        .map_err(PyValueError::new_err)?;
        let pool = Arc::new(pool);
        let stopping = running.shutdown.subscribe();
        if let Some(interval) = pool.eviction_interval() {
            running
                .runtime
                .spawn(Arc::clone(&pool).evict_forever(interval, stopping));
        }
        self.shared.set_pool(pool).retire();
        Ok(())
    }

    /// One health probe's verdict on the engine at `url` (`error` None: it passed), from the
    /// process's one prober (the engine registry's): the front probes nothing itself. It
    /// flips the engine's health at the `--health-*-threshold`s, as a probe of its own did.
    /// False when the front's current set has no engine at `url`.
    #[pyo3(signature = (url, error = None))]
    fn probed(&self, url: &str, error: Option<String>) -> bool {
        self.shared.pool().probed_url(url, error)
    }

    /// A `GET /v1/loads` poll's outcome for the engine at `url` (`report` None: it gave
    /// none), from the process's one load poll (the engine registry's): the policy's
    /// `set_loads`. False when the front's current set has no engine at `url`; a ValueError
    /// for a report the policy refuses.
    #[pyo3(signature = (url, report = None))]
    fn loads(&self, url: &str, report: Option<(i64, i64, i64, f64, f64)>) -> PyResult<bool> {
        let report = match report {
            Some((running, waiting, tokens, usage, rate)) => Some(
                LoadReport::new(running, waiting, tokens, usage, rate)
                    .map_err(PyValueError::new_err)?,
            ),
            None => None,
        };
        Ok(self.shared.pool().loads_url(url, report))
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let snap = self.shared.stats.snapshot();
        let requests = PyDict::new(py);
        for (status, count) in snap.requests {
            requests.set_item(status, count)?;
        }
        let latency = PyDict::new(py);
        latency.set_item("buckets", snap.buckets)?;
        latency.set_item("count", snap.count)?;
        latency.set_item("sum", snap.sum_seconds)?;
        let upstreams = PyList::empty(py);
        for state in self.shared.pool().states() {
            let entry = PyDict::new(py);
            entry.set_item("url", state.url)?;
            entry.set_item("healthy", state.healthy)?;
            entry.set_item("in_flight", state.in_flight)?;
            entry.set_item("sent", state.sent)?;
            entry.set_item("circuit_breaker", state.circuit_breaker)?;
            entry.set_item("retries", state.retries)?;
            entry.set_item("lost", state.lost)?;
            if let Some(error) = state.last_error {
                entry.set_item("last_error", error)?;
            }
            upstreams.append(entry)?;
        }
        let out = PyDict::new(py);
        out.set_item("requests", requests)?;
        out.set_item("latency", latency)?;
        out.set_item("handoffs", snap.handoffs)?;
        out.set_item("connections", snap.connections)?;
        out.set_item("upstreams", upstreams)?;
        let (held, leads_held, leads_followed, warmups, failed) =
            self.shared.pool().sibling_counts();
        let siblings = PyDict::new(py);
        siblings.set_item("siblings_held", held)?;
        siblings.set_item("leads_held", leads_held)?;
        siblings.set_item("leads_followed", leads_followed)?;
        siblings.set_item("warmups", warmups)?;
        siblings.set_item("warmups_failed", failed)?;
        out.set_item("siblings", siblings)?;
        Ok(out)
    }

    /// Stop accepting, let in-flight requests finish for up to `grace` seconds, then shut
    /// the runtime down and close untaken hand-offs. Idempotent; the GIL is released.
    fn stop(&self, py: Python<'_>, grace: f64) -> PyResult<()> {
        if grace.is_nan() || grace < 0.0 {
            return Err(PyValueError::new_err(format!(
                "grace must be >= 0 seconds, got {grace}"
            )));
        }
        let grace =
            Duration::try_from_secs_f64(grace).map_or(MAX_DURATION, |d| d.min(MAX_DURATION));
        // The lock is held throughout, so a concurrent stop() returns only once it is done.
        py.allow_threads(|| {
            let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(running) = running.take() {
                finish(&self.shared, running, grace);
            }
        });
        Ok(())
    }

    fn __repr__(&self) -> String {
        let urls: Vec<String> = self
            .shared
            .pool()
            .states()
            .into_iter()
            .map(|s| s.url)
            .collect();
        // try_lock: a stop() in progress holds the lock for its whole grace period.
        let state = match self.running.try_lock() {
            Ok(running) if running.is_some() => "serving",
            Ok(_) => "stopped",
            Err(_) => "stopping",
        };
        format!("<CompiledFront {state} upstreams={urls:?}>")
    }
}

fn finish(shared: &Shared, running: Running, grace: Duration) {
    // Idle connections close at once; the others finish their request.
    running.shutdown.send_replace(true);
    let deadline = std::time::Instant::now() + grace;
    while shared.stats.connections() > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(STOP_POLL);
    }
    // Drops every task left, closing its connection.
    running.runtime.shutdown_timeout(RUNTIME_SHUTDOWN);
    shared.close_handoffs();
}

impl Drop for CompiledFront {
    fn drop(&mut self) {
        // Garbage collected without stop(): no grace, but no thread or fd left behind.
        let running = self
            .running
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(running) = running {
            finish(&self.shared, running, Duration::ZERO);
        }
    }
}

/// Test hook (`rust/testing.rs`): "proxy" when the front serves the request itself,
/// "dispatch" when Python answers it on the front's connection, else "handoff" (`route.rs`).
#[pyfunction]
#[pyo3(signature = (method, target, headers, session_headers))]
pub(crate) fn front_route(
    method: &Bound<'_, PyString>,
    target: &Bound<'_, PyString>,
    headers: Vec<(Bound<'_, PyString>, Bound<'_, PyString>)>,
    session_headers: Vec<Bound<'_, PyString>>,
) -> PyResult<&'static str> {
    // Lossy is exact here: a lone surrogate becomes U+FFFD, which is as far from the ASCII
    // method names and paths compared against as the surrogate itself.
    let method = method.to_string_lossy();
    let target = target.to_string_lossy();
    let mut failed = None;
    let decision = decide(method.as_bytes(), target.as_bytes(), || {
        session_in_python(&headers, &session_headers).unwrap_or_else(|e| {
            failed = Some(e);
            false
        })
    });
    match failed {
        Some(error) => Err(error),
        None => Ok(decision.as_str()),
    }
}

/// `header_session_id(headers, names) is not None`, with Python's own lowering and string
/// equality (`route::has_session_header` is the wire twin).
fn session_in_python(
    headers: &[(Bound<'_, PyString>, Bound<'_, PyString>)],
    names: &[Bound<'_, PyString>],
) -> PyResult<bool> {
    let lowered = headers
        .iter()
        .map(|(name, _)| py_lower(name))
        .collect::<PyResult<Vec<_>>>()?;
    for name in names {
        let name = py_lower(name)?;
        for (index, header) in lowered.iter().enumerate().rev() {
            // The last duplicate is the one the dict keeps.
            if header.eq(&name)? {
                if headers[index].1.len()? > 0 {
                    return Ok(true);
                }
                break;
            }
        }
    }
    Ok(false)
}

/// Test hook (`rust/testing.rs`): the headers the front passes on (`hop.rs`): of a request
/// when `reply` is false, else of an upstream reply; order and duplicates kept. The twin of
/// `http/forwarding.py`.
#[pyfunction]
#[pyo3(signature = (headers, reply = false))]
pub(crate) fn front_forwarded_headers(
    headers: Vec<(String, Vec<u8>)>,
    reply: bool,
) -> Vec<(String, Vec<u8>)> {
    let named = hop::connection_named(headers.iter().map(|(k, v)| (k.as_bytes(), v.as_slice())));
    let keep = if reply { hop::relayed } else { hop::forwarded };
    headers
        .into_iter()
        .filter(|(name, _)| keep(name.as_bytes(), &named))
        .collect()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CompiledFront>()?;
    m.add_class::<dispatch::DispatchedRequest>()?;
    Ok(())
}
