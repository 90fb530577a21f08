//! State shared by the front's tasks, the accept loop and the queues to Python (hand-offs,
//! dispatched requests, writable wake-ups), which share one wake-up pipe.

use std::fs::File;
use std::io::Write as _;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::dispatch::DispatchedRequest;
use super::stats::Stats;
use super::upstream::Pool;

/// The request-handling settings, validated by the constructor.
pub struct Config {
    pub max_body: u64,
    pub api_key: Option<Vec<u8>>,
    /// Session header names lowercased by Python's `str.lower()`.
    pub session_names: Vec<Vec<u8>>,
    pub header_timeout: Duration,
    /// The timeouts as the Python server quotes them in its 408 messages.
    pub header_timeout_text: String,
    pub body_timeout: Duration,
    pub body_timeout_text: String,
    pub keepalive_timeout: Duration,
    pub upstream_timeout: Duration,
    /// Requests Python answers go to it as requests (`dispatch.rs`); false: hand-offs.
    pub dispatch: bool,
}

pub struct Shared {
    pub config: Config,
    pub stats: Stats,
    /// The engines stateless requests are relayed to; replaced whole when the engine set
    /// changes (`set_pool`): a request keeps the pool it started on until it is done.
    pool: RwLock<Arc<Pool>>,
    /// Whether stateless proxy requests are relayed by this front to `pool` (true) or
    /// dispatched to Python, whose session core proxies them through its own upstream pool
    /// (false): Python turns it off while the engine set is empty or one engine cannot be
    /// relayed to by this front (not plain http).
    relay: AtomicBool,
    handoffs: Mutex<Handoffs>,
    next_request: AtomicU64,
}

struct Handoffs {
    /// Connections for Python, with the bytes already read from them.
    queue: Vec<(OwnedFd, Bytes)>,
    /// Requests for Python to answer.
    requests: Vec<DispatchedRequest>,
    /// Ids of dispatched requests whose reply queue drained while Python waited.
    writable: Vec<u64>,
    /// Our own duplicate of the write end of Python's wake-up pipe; None once stopped.
    notify: Option<File>,
}

impl Handoffs {
    /// One byte per event; a full pipe (EAGAIN) already wakes the reader. Written under the
    /// lock (a non-blocking write) so `close_handoffs` cannot race it. False once stopped.
    fn wake(&self) -> bool {
        match &self.notify {
            Some(notify) => {
                let _ = (&*notify).write(&[1]);
                true
            }
            None => false,
        }
    }
}

impl Shared {
    pub fn new(config: Config, stats: Stats, pool: Arc<Pool>, notify: OwnedFd) -> Self {
        Self {
            config,
            stats,
            pool: RwLock::new(pool),
            relay: AtomicBool::new(true),
            handoffs: Mutex::new(Handoffs {
                queue: Vec::new(),
                requests: Vec::new(),
                writable: Vec::new(),
                notify: Some(File::from(notify)),
            }),
            next_request: AtomicU64::new(1),
        }
    }

    /// The current pool (a clone of its handle: hold it for the whole request).
    pub fn pool(&self) -> Arc<Pool> {
        Arc::clone(&self.pool.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Install `pool` for new requests; the old one is returned (to retire it).
    pub fn set_pool(&self, pool: Arc<Pool>) -> Arc<Pool> {
        let mut current = self.pool.write().unwrap_or_else(|p| p.into_inner());
        std::mem::replace(&mut *current, pool)
    }

    pub fn relays(&self) -> bool {
        self.relay.load(Relaxed)
    }

    pub fn set_relay(&self, relay: bool) {
        self.relay.store(relay, Relaxed);
    }

    pub fn request_id(&self) -> u64 {
        self.next_request.fetch_add(1, Relaxed)
    }

    /// Queue a request for Python and wake its loop; false once stopped (nobody would
    /// answer it).
    pub fn dispatch(&self, request: DispatchedRequest) -> bool {
        let mut handoffs = lock(&self.handoffs);
        if !handoffs.wake() {
            return false;
        }
        handoffs.requests.push(request);
        true
    }

    /// Tell Python that request `id` may send again.
    pub fn writable(&self, id: u64) {
        let mut handoffs = lock(&self.handoffs);
        if handoffs.wake() {
            handoffs.writable.push(id);
        }
    }

    pub fn take_requests(&self) -> Vec<DispatchedRequest> {
        std::mem::take(&mut lock(&self.handoffs).requests)
    }

    pub fn take_writable(&self) -> Vec<u64> {
        std::mem::take(&mut lock(&self.handoffs).writable)
    }

    /// Queue `stream` for Python with `data` (everything read from the current request on)
    /// and wake its loop.
    pub fn hand_off(&self, stream: TcpStream, data: Bytes) {
        // Deregistered from tokio and left non-blocking; Python sets the mode it wants.
        let Ok(stream) = stream.into_std() else {
            // Not deregistrable (never seen): dropping it closes the connection.
            return;
        };
        let mut handoffs = lock(&self.handoffs);
        // Stopped: nobody would take it; dropping the fd closes the connection.
        if !handoffs.wake() {
            return;
        }
        handoffs.queue.push((OwnedFd::from(stream), data));
        self.stats.handoff();
    }

    pub fn take_handoffs(&self) -> Vec<(OwnedFd, Bytes)> {
        std::mem::take(&mut lock(&self.handoffs).queue)
    }

    /// After the runtime is gone: close the untaken hand-offs and our end of the pipe.
    pub fn close_handoffs(&self) {
        let mut handoffs = lock(&self.handoffs);
        handoffs.notify = None;
        handoffs.queue.clear();
        handoffs.requests.clear();
        handoffs.writable.clear();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Counts a Rust-owned connection from its accept until its task lets it go.
pub struct OpenConnection(Arc<Shared>);

impl OpenConnection {
    fn new(shared: &Arc<Shared>) -> Self {
        shared.stats.connection_opened();
        Self(Arc::clone(shared))
    }

    pub fn shared(&self) -> &Arc<Shared> {
        &self.0
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.stats.connection_closed();
    }
}

/// Accept until shutdown; each connection gets its own task.
pub async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            biased;
            _ = shutdown.wait_for(|stopping| *stopping) => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, _)) => {
                let _ = stream.set_nodelay(true);
                // Counted before the task starts, so stop() never misses it.
                let open = OpenConnection::new(&shared);
                tokio::spawn(super::conn::serve(open, stream, shutdown.clone()));
            }
            // Out of fds or memory, or an aborted handshake: back off a little instead of
            // spinning on an error that a closing connection will soon clear.
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}
