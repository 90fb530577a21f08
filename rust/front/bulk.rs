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
    while let Ok(job) = jobs.recv() {
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
