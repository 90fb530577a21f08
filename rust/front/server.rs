//! State shared by the front's tasks, the accept loop and the hand-off queue.

use std::fs::File;
use std::io::Write as _;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

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
}

pub struct Shared {
    pub config: Config,
    pub stats: Stats,
    pub pool: Arc<Pool>,
    handoffs: Mutex<Handoffs>,
}

struct Handoffs {
    /// Connections for Python, with the bytes already read from them.
    queue: Vec<(OwnedFd, Bytes)>,
    /// Our own duplicate of the write end of Python's wake-up pipe; None once stopped.
    notify: Option<File>,
}

impl Shared {
    pub fn new(config: Config, stats: Stats, pool: Arc<Pool>, notify: OwnedFd) -> Self {
        Self {
            config,
            stats,
            pool,
            handoffs: Mutex::new(Handoffs {
                queue: Vec::new(),
                notify: Some(File::from(notify)),
            }),
        }
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
        let Some(notify) = &handoffs.notify else {
            return;
        };
        // One byte per hand-off; a full pipe (EAGAIN) already wakes the reader. Written
        // under the lock (a non-blocking write) so `close_handoffs` cannot race it.
        let _ = (&*notify).write(&[1]);
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
