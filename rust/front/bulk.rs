//! The thread that copies file parts to clients (`sendfile`), at a lower priority than the
//! runtime's threads.
//!
//! Records GETs reach the front as shared-memory files, and the kernel's copy to the socket
//! was done on the runtime's threads: four clients reading large GETs at ~1.4 GB/s kept both
//! cores of a 2-core machine busy with it, and a small chat meanwhile waited for a thread (p99
//! 43-92 ms against 10-18 ms when the same bytes came as frames, docs/performance.md). Here a
//! connection's task hands each slice to this one thread, niced, and awaits it: the copy yields
//! the cores to whatever serves small requests, and a GET slows down only while they run.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

/// The sending thread's niceness: the worker's segment writer's (see reply_files.py).
const BULK_NICE: libc::c_int = 10;

/// One `sendfile` call: the descriptors are the job's own (duplicates), so a connection task
/// dropped meanwhile cannot close a number the thread is still using.
struct Job {
    socket: Arc<OwnedFd>,
    source: Arc<OwnedFd>,
    offset: libc::off_t,
    count: usize,
    done: oneshot::Sender<std::io::Result<(usize, libc::off_t)>>,
}

fn sender() -> Option<&'static mpsc::Sender<Job>> {
    static SENDER: OnceLock<Option<mpsc::Sender<Job>>> = OnceLock::new();
    SENDER
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name("sg-bulk".into())
                .spawn(move || run(&rx))
                .ok()
                .map(|_| tx)
        })
        .as_ref()
}

fn run(jobs: &mpsc::Receiver<Job>) {
    // SAFETY: plain syscalls on this thread's own id; a failure leaves the default priority.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, BULK_NICE);
    }
    let mut pressure = Pressure::new();
    while let Ok(job) = jobs.recv() {
        if pressure.contended() {
            std::thread::sleep(PAUSE);
        }
        let mut offset = job.offset;
        // SAFETY: both descriptors are owned by the job and open until it is dropped;
        // `offset` is a live local the kernel advances.
        let n = unsafe {
            libc::sendfile(
                job.socket.as_raw_fd(),
                job.source.as_raw_fd(),
                &mut offset,
                job.count,
            )
        };
        let result = usize::try_from(n)
            .map(|sent| (sent, offset))
            .map_err(|_| std::io::Error::last_os_error());
        let _ = job.done.send(result); // the connection may be gone: nothing to tell
    }
}

/// How often the machine's CPU pressure is read.
const WINDOW: Duration = Duration::from_millis(10);
/// The share of a window with some task waiting for a CPU above which sends pause. (On 2
/// cores with four clients reading GETs: 0.5 held GETs to 630-645 MiB/s, below frames'
/// ~850; 0.8 gives 870-920 MiB/s with small chats' p99 at 9-14 ms; docs/performance.md.)
const STALLED: f64 = 0.8;
/// The pause before a slice while the CPU is contended.
const PAUSE: Duration = Duration::from_millis(1);

/// The kernel's CPU pressure (PSI, /proc/pressure/cpu): how long some runnable task waited
/// for a CPU. Bulk sends pause while it is high, so the cores go to what serves small
/// requests (and to the clients' own receive copies) rather than to more bulk bytes; with
/// cores to spare it never pauses. The Python front's twin: transport/cpu_pressure.py.
struct Pressure {
    read_at: Instant,
    total_us: Option<u64>,
    contended: bool,
}

impl Pressure {
    fn new() -> Self {
        Self {
            read_at: Instant::now(),
            total_us: read_stall_us(),
            contended: false,
        }
    }

    fn contended(&mut self) -> bool {
        let elapsed = self.read_at.elapsed();
        if elapsed < WINDOW {
            return self.contended;
        }
        let total = read_stall_us();
        self.contended = pauses(self.total_us, total, elapsed.as_micros());
        self.total_us = total;
        self.read_at = Instant::now();
        self.contended
    }
}

fn read_stall_us() -> Option<u64> {
    psi_some_total(&std::fs::read_to_string("/proc/pressure/cpu").ok()?)
}

/// `total=N` of the `some` line of a PSI file: microseconds some task was stalled.
pub(crate) fn psi_some_total(text: &str) -> Option<u64> {
    let some = text.lines().find(|line| line.starts_with("some "))?;
    some.split_whitespace()
        .find_map(|field| field.strip_prefix("total="))?
        .parse()
        .ok()
}

/// Whether sends pause, from two readings `elapsed_us` apart. Without both readings (no PSI:
/// an old kernel, some containers) never; a counter that went back counts as no stall.
pub(crate) fn pauses(before: Option<u64>, after: Option<u64>, elapsed_us: u128) -> bool {
    match (before, after) {
        (Some(before), Some(after)) => {
            after.saturating_sub(before) as f64 > elapsed_us as f64 * STALLED
        }
        _ => false,
    }
}

/// Test hook (rust/testing.rs): `pauses` over two PSI texts.
#[pyo3::pyfunction]
pub fn front_bulk_pauses(before: &str, after: &str, elapsed_us: u64) -> bool {
    pauses(
        psi_some_total(before),
        psi_some_total(after),
        u128::from(elapsed_us),
    )
}

/// Descriptors of one file part for the bulk thread.
pub(crate) struct BulkPart {
    socket: Arc<OwnedFd>,
    source: Arc<OwnedFd>,
}

impl BulkPart {
    /// None when a descriptor cannot be duplicated (then the caller sends in place).
    pub(crate) fn new(socket: BorrowedFd<'_>, source: BorrowedFd<'_>) -> Option<Self> {
        Some(Self {
            socket: Arc::new(socket.try_clone_to_owned().ok()?),
            source: Arc::new(source.try_clone_to_owned().ok()?),
        })
    }

    /// One `sendfile` of up to `count` bytes from `offset` on the bulk thread: the bytes
    /// sent and the new offset, or the call's error (WouldBlock when the socket is full).
    pub(crate) async fn send(
        &self,
        offset: libc::off_t,
        count: usize,
    ) -> std::io::Result<(usize, libc::off_t)> {
        let (done, answer) = oneshot::channel();
        let job = Job {
            socket: Arc::clone(&self.socket),
            source: Arc::clone(&self.source),
            offset,
            count,
            done,
        };
        let gone = || std::io::Error::other("the bulk sender thread is gone");
        sender().ok_or_else(gone)?.send(job).map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
    }
}
